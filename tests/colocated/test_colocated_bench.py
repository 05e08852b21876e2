"""The colocated benchmark's logic on CPU with tiny shapes (the GPU run uses the same code on one H200)."""

from __future__ import annotations

import json

from refit_core.bench.colocated import main


def test_colocated_benchmark_runs_every_method_bitwise_and_reports_ratios(tmp_path, capsys):
    prefix = str(tmp_path / "colocated")
    models = ("tiny-llama", "tiny-qwen3-moe", "tiny-qwen3-moe:sequential")
    rc = main(["--device", "cpu", "--models", ",".join(models), "--iters", "1", "--warmup", "1",
               "--timeout-s", "60", "--bound-gib", "0.001", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0, report
    rows = {(r["model"], r["method"]): r for r in report["rows"]}
    assert set(rows) == {(m, k) for m in models for k in ("copy-bound", "ping-pong", "refit")}
    for (model, method), row in rows.items():
        assert row["ms"] > 0 and row["of_bound"] > 0
        if method != "copy-bound":
            assert row["checks"] == ["bitwise ok"], (model, method, row)
    for model in models:
        refit, pingpong = rows[(model, "refit")], rows[(model, "ping-pong")]
        assert refit["info"]["links"] == ["shared-memory"]
        assert refit["shared_bytes"] == 0 and pingpong["shared_bytes"] == 2 * (1 << 30)  # 2 x 1 GiB buffers
        assert 0 < refit["info"]["copies"] < 40  # batched: a few copies per layer, not one per tensor
        assert refit["staging_bytes"] == {"trainer": 0, "engine": 0}  # straight out of the trainer's memory
        counts = refit["info"]["copy_counts"]
        assert counts["launches"] == refit["info"]["copies"] and counts["copies"] < counts["segments"]
    sequential = rows[("tiny-qwen3-moe:sequential", "refit")]["info"]["copy_counts"]
    assert sequential["batched"] >= 2 * 8 and sequential["launches"] <= 3  # 2 layers x 8 experts, batched
    text = open(prefix + ".md").read()
    assert "| tiny-qwen3-moe | refit |" in text and "0.00 GiB staged" in text
    assert "of copy bound" in capsys.readouterr().out
