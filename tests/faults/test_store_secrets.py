"""Launchers that start every rank themselves give the job a random secret: ``refit demo`` (through
the side programs' environment, never their command line), the Ray helper (with the options),
``spawn`` (its ranks' environment) and torchrun (derived from its random run id)."""

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


def _secret_of_rank(rank: int, nprocs: int) -> str:
    import os
    return os.environ.get("REFIT_SECRET", "")


def test_spawned_ranks_share_a_fresh_secret_unless_one_is_given(monkeypatch):
    from refit_core.kit.launch import spawn

    monkeypatch.delenv("REFIT_SECRET", raising=False)
    first, second = spawn(_secret_of_rank, 2, timeout_s=120)
    assert HEX_SECRET.fullmatch(first) and first == second  # one job: one secret for all its ranks
    assert spawn(_secret_of_rank, 1, env={"REFIT_SECRET": "mine"}, timeout_s=120) == ["mine"]
    assert spawn(_secret_of_rank, 1, env={"REFIT_INSECURE": "1"}, timeout_s=120) == [""]  # opted out by name


def test_torchrun_ranks_derive_one_secret_from_a_random_run_id_only():
    from uuid import uuid4

    from refit_core.contract.env import launcher_secret

    run = {"TORCHELASTIC_RUN_ID": str(uuid4())}
    derived = with_overrides(RefitOptions(), run)
    assert HEX_SECRET.fullmatch(derived.secret or "") and derived.secret == launcher_secret(dict(run))
    assert derived.secret != launcher_secret({"TORCHELASTIC_RUN_ID": str(uuid4())})  # another run, another secret
    assert "secret" not in derived.explicit and with_overrides(RefitOptions(secret="mine"), run).secret == "mine"
    assert with_overrides(RefitOptions(insecure=True), run).secret is None  # the opt-out is taken as said
    for named in ("none", "my-job", ""):  # torchrun's default and a chosen name are no secrets
        assert launcher_secret({"TORCHELASTIC_RUN_ID": named}) is None
