"""Launchers that start every rank themselves give the job a random secret: ``refit demo`` (through
the side programs' environment, never their command line) and the Ray helper (with the options)."""

import re

from tests.environments import require

from refit_core.contract.env import with_overrides
from refit_core.contract.options import RefitOptions
from refit_core.tools.cli import main
from refit_core.tools.demo.runner import side_environment

HEX_SECRET = re.compile(r"[0-9a-f]{32}")


def test_refit_demo_hands_both_sides_a_fresh_secret_unless_one_is_given():
    options: dict = {"timeout_s": 30}
    env = side_environment(options, {"PATH": "/bin"})
    assert HEX_SECRET.fullmatch(env["REFIT_SECRET"]) and env["PATH"] == "/bin"
    assert side_environment({}, {})["REFIT_SECRET"] != env["REFIT_SECRET"]  # fresh every run
    assert with_overrides(RefitOptions(**options), env).secret == env["REFIT_SECRET"]  # what each side uses
    given = {"secret": "mine", "timeout_s": 30}
    assert side_environment(given, {})["REFIT_SECRET"] == "mine" and "secret" not in given  # off the command line
    assert side_environment({}, {"REFIT_SECRET": "operator's"})["REFIT_SECRET"] == "operator's"


def test_the_ray_helper_gives_every_actor_the_same_fresh_secret_unless_one_is_given():
    require("ray")
    from refit_core.kit.ray import RayRefit

    first, second = RayRefit([object()], [object()]), RayRefit([object()], [object()], timeout_s=5)
    assert HEX_SECRET.fullmatch(first.options.secret or "") and first.options.secret != second.options.secret
    assert second.options.timeout_s == 5 and "secret" not in second.options.explicit  # the options, otherwise as given
    assert RayRefit([object()], [object()], options=RefitOptions(secret="mine")).options.secret == "mine"


def test_refit_secret_prints_a_fresh_secret(capsys):
    assert main(["secret"]) == 0 and main(["secret"]) == 0
    first, second = capsys.readouterr().out.split()
    assert HEX_SECRET.fullmatch(first) and first != second
