"""``refit bench`` on CPU (gloo): every method of the benchmark lands every byte, bitwise."""

from __future__ import annotations

import json

from refit_core.kit.models import PRESETS


def test_bench_smoke_on_cpu(tmp_path, monkeypatch):
    from refit_core.tools.bench import main

    config = dict(PRESETS["tiny-qwen3-moe"], hidden_size=128, moe_intermediate_size=64, num_experts=8,
                  vocab_size=512)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("REFIT_DIRECT_MIN_BYTES", "4096")  # exercise own messages and zero-copy at toy size
    prefix = str(tmp_path / "out")
    rc = main(["--device", "cpu", "--models", f"tiny-llama,{path}", "--methods",
               "wire,per-tensor,packed,refit,refit@zero_copy=0", "--warmup", "1", "--iters", "1",
               "--min-iters", "1", "--bucket-mib", "1", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0
    for model in report["models"]:
        checks = {r["method"]: r["checks"] for r in model["rows"]}
        assert checks["wire"] == ["checksum ok"]
        assert all(checks[m] == ["bitwise ok"] for m in ("per-tensor", "packed", "refit", "refit@zero_copy=0"))
    text = open(prefix + ".md").read()
    assert text.startswith("# refit bench")
    assert "refit setup (slowest rank per phase): " in text and "the planner (train rank 0) planned in " in text
    for model in report["models"]:  # the planner read every rank's metadata, the other rank only its part
        setup = next(r for r in model["rows"] if r["method"] == "refit")["setup"]
        assert setup["planner_plan_s"] > 0 and setup["planner_read_bytes"] > 0 and setup["other_read_bytes"] > 0
