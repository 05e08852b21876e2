"""``refit check-plugin NAME``: the kit's model-free checks from the command line."""

import subprocess
import sys


def refit(*args):
    return subprocess.run([sys.executable, "-m", "refit_core", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_check_plugin_runs_the_published_suite_and_passes():
    out = refit("check-plugin", "toy")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASSED  refuses train layout 'tp=2'" in out.stdout
    assert out.stdout.strip().endswith("refit check-plugin toy: 14 checks passed, 0 failed, 0 skipped")


def test_check_plugin_fails_naming_the_tensors_when_the_backend_ignores_the_model():
    """The toy's models are fixed: asked for tiny-llama they do not hold its tensors."""
    out = refit("check-plugin", "toy", "--model", "tiny-llama", "--train-layout", "dp=2", "--gen-layout", "")
    assert out.returncode == 1
    assert "FAILED  train layout tiny-llama dp=2" in out.stdout
    assert ("16 destination tensor(s) have no source: lm_head.weight, model.layers.0.input_layernorm.weight"
            in out.stdout)
    assert "model.embed_tokens.weight: 63488 of 65536 elements are received by no gen rank" in out.stdout


def test_check_plugin_of_an_unknown_plugin_is_a_clear_error():
    out = refit("check-plugin", "nope")
    assert out.returncode == 2 and "no installed refit plugin named 'nope'" in out.stderr
