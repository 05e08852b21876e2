"""A plugin written against the plugin guide from before ``refit_core`` moved into role subpackages still
passes the conformance kit and runs ``refit demo``, unchanged.

The plugin is the example toy plugin as it was then: ``toy-before-the-move.diff`` undoes what the move
changed in it (imports from ``refit_core.spec``, ``.models``, ``.verify``, ``.launch``,
``.demo.context``; demo programs handed to ``Backend`` itself). The old copy shadows the installed
``refit_toy`` on ``PYTHONPATH`` (its entry point names the same module), in the kit's own pytest run and
in both programs of ``refit demo``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TOY = HERE.parent / "example_plugin" / "refit_toy"
PATCH = HERE / "toy-before-the-move.diff"


@pytest.fixture(scope="module")
def old_toy_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment in which ``refit_toy`` is the plugin as written before the move."""
    root = tmp_path_factory.mktemp("old-toy")
    shutil.copytree(TOY, root / "refit_toy", ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["patch", "-p1", "-d", str(root), "-i", str(PATCH)], capture_output=True, text=True)
    assert applied.returncode == 0, ("the toy plugin changed since toy-before-the-move.diff was made: regenerate it "
                                     f"(diff -ruN new old)\n{applied.stdout}{applied.stderr}")
    assert "from refit_core.spec import TensorSpec" in (root / "refit_toy" / "models.py").read_text()
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


KIT_CHECKS = ("test_model_free_checks", "test_round_trip[train-toy-dp=2]",
              "test_round_trip[gen-toy-odd-experts-dp=3]")
"""What of the kit the old copy runs: every model-free check, and one round trip per side, together on
both models. The diff changes imports, the registration and ``verify_engine``'s odd-experts branch
(which the gen round trip of the odd model runs); the other bodies are the current plugin's, whose
every round trip ``test_toy_conformance.py`` runs in this suite (two more here would repeat them, 22 s)."""


def test_the_old_plugin_passes_the_conformance_kit(old_toy_env: dict[str, str]) -> None:
    kit = HERE / "test_toy_conformance.py"
    checks = [f"{kit}::TestToyConformance::{check}" for check in KIT_CHECKS]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                          "always::DeprecationWarning", *checks],
                         env=old_toy_env, capture_output=True, text=True, timeout=300, cwd=HERE.parent.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(rf"\b{len(KIT_CHECKS)} passed", out.stdout) and " failed" not in out.stdout, out.stdout[-4000:]
    # the kit ran the old code: its imports of the moved paths warned
    assert "refit_core.verify moved: import its names from refit_core.kit" in out.stdout, out.stdout[-4000:]


def test_the_old_plugin_runs_refit_demo(old_toy_env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "toy", "--gen", "toy", "--steps", "2"],
                         env={**old_toy_env, "PYTHONWARNINGS": "always::DeprecationWarning"}, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "verified OK" in out.stdout
    # the demo layouts came from the old Backend(demo_train_layout="dp=2", demo_gen_layout="dp=3")
    assert "toy(dp=2) -> toy(dp=3)" in out.stdout, out.stdout
