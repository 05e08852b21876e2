"""``refit demo --train dtensor --gen vllm --model DIR`` for architectures outside refit's built-in table.

Each model directory is written here (config.json + safetensors with random weights); the demo
takes its tensor inventory from the safetensors headers, trains FSDP2 over 2 ranks, refits a real
vLLM engine, and passes only if vLLM's greedy generation equals HF transformers' with the same
weights. The console must stay quiet: phase lines and the summary, no engine logs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.environments import require

require("vllm")
require("refit_dtensor")
require("refit_vllm")

from architectures import ARCHITECTURES, CHARACTERISTIC_TENSORS, write_random_model

from refit_core.kit.inventory import TABLE_ARCHITECTURES, safetensors_specs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_refit_demo_any_architecture(name: str, tmp_path: Path) -> None:
    model_dir = write_random_model(name, tmp_path / name)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"][0] not in TABLE_ARCHITECTURES
    names = {s.name for s in safetensors_specs(model_dir) or []}
    assert set(CHARACTERISTIC_TENSORS[name]) <= names

    proc = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "dtensor", "--gen", "vllm",
                           "--model", str(model_dir), "--steps", "1"], check=False, capture_output=True, text=True,
                          timeout=900)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "from safetensors headers" in lines[0], lines[0]
    assert lines[-1].endswith("verified OK"), lines[-1]
    step = [line for line in lines if line.lstrip().startswith("step 0")]
    assert len(step) == 1 and "generation == HF transformers" in step[0] and "GB/s" in step[0], lines
    for phase in ("build", "setup", "verify"):
        assert any(line.lstrip().startswith(phase) for line in lines), f"no {phase} line in {lines}"
    assert len(lines) <= 10 and not any(word in proc.stdout for word in ("INFO", "WARNING", "Traceback")), lines
