"""``refit demo --train megatron`` into both destinations, as a user runs it (CPU, gloo).

The demo's trainer is megatron-core TP2 (2 ranks); the DTensor side checks every byte against
``reference_state_dict``, the vLLM side checks greedy generation against HF transformers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.environments import require

require("megatron.core")


@pytest.mark.parametrize("gen,expect", [
    # the dtensor side's demo program, its default layout and its bitwise verdict (the only run of that
    # program in a demo of two backends; the dtensor trainer's demo program runs in tests/vllm)
    ("dtensor", ("megatron(tp=2) -> dtensor(tp=2)", "bitwise equal on every rank",
                 "every destination view equals the reference bit for bit after every step")),
    pytest.param("vllm", ("megatron(tp=2) -> vllm(single)",
                          "greedy generation equals HF transformers' token for token"), marks=pytest.mark.vllm),
])
def test_refit_demo_from_megatron_runs_on_cpu_and_verifies(gen, expect):
    if gen == "vllm":
        require("vllm")
    out = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "megatron", "--gen", gen],
                         capture_output=True, text=True, timeout=500, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    for line in expect:
        assert line in out.stdout, out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith("verified OK")
