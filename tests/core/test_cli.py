"""The command line: plan from metadata alone, and clear errors for bad input."""

import subprocess
import sys


def refit(*args):
    return subprocess.run([sys.executable, "-m", "refit_core.cli", *args], capture_output=True, text=True, timeout=120)


def test_plan_prints_the_summary_from_metadata_alone():
    out = refit("plan", "--model", "tiny-llama", "--train", "toy:dp=2", "--gen", "toy:dp=3", "--bucket-mb", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for field in ("ranks:        2 train -> 3 gen", "bytes:", "messages:", "busiest:", "planned in:"):
        assert field in text
    # toy: 32.4 KiB reaches each gen rank's replicated qkv+norm, columns and experts
    assert "32.4 KiB" in text


def test_plan_rejects_unknown_layout_keys_and_backends():
    out = refit("plan", "--model", "tiny-llama", "--train", "toy:zz=2", "--gen", "toy")
    assert out.returncode == 2 and "layout item 'zz=2': expected KEY=N" in out.stderr
    out = refit("plan", "--model", "tiny-llama", "--train", "nope:tp=2", "--gen", "toy")
    assert out.returncode == 2 and "no installed plugin provides a train backend named 'nope'" in out.stderr


def test_unknown_model_is_a_clear_error():
    out = refit("plan", "--model", "no-such-model", "--train", "toy", "--gen", "toy")
    assert out.returncode == 2 and "neither a preset" in out.stderr
