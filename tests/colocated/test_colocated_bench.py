"""The colocated benchmark's logic on CPU with tiny shapes (the GPU run uses the same code on one H200)."""

from __future__ import annotations

import json

from refit_core.run.timing import StepTrace, breakdown
from refit_core.tools.bench.colocated import main


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
        check = row["of_bound_check"]  # a loaded CPU may time a copy slower than refit: then flagged, not printed
        assert row["ms"] > 0 and check["value"] > 0 and (check["valid"] or "above the bound" in check["reason"])
        assert row["of_bound"] == (check["value"] if check["valid"] else None)
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



def test_an_fp8_engine_is_quantized_from_the_trainers_memory_bitwise(tmp_path, capsys):
    """``--fp8-block``: the engine holds block-FP8 linear weights; refit quantizes straight out of the
    trainer's memory (bitwise against refit's quantizer), and ping-pong, which cannot, is left out."""
    prefix = str(tmp_path / "colocated-fp8")
    rc = main(["--device", "cpu", "--models", "tiny-llama", "--iters", "1", "--warmup", "1", "--fp8-block", "32",
               "--timeout-s", "60", "--bound-gib", "0.001", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0 and report["fp8_block"] == 32, report
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"copy-bound", "refit"}
    assert rows["refit"]["checks"] == ["bitwise ok"]
    assert "does not quantize" in capsys.readouterr().err
    assert "block FP8 (32 x 32)" in open(prefix + ".md").read()

def test_variants_run_side_by_side_bitwise_with_a_breakdown_of_each_step(tmp_path, capsys):
    """``--variants``: the copy bound and refit once per StridedCopy in one run, each checked bitwise,
    each with the median phases of its traced steps (host marks of both processes on one clock)."""
    prefix = str(tmp_path / "variants")
    rc = main(["--device", "cpu", "--models", "tiny-llama", "--variants", "--iters", "2", "--warmup", "0",
               "--timeout-s", "60", "--bound-gib", "0.001", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0, report
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["copy-bound", "refit:kernel", "refit:blocks", "refit:foreach", "refit:memcpy2d",
                          "refit:triton", "refit:foreach+check-first", "refit:triton+check-first",
                          "refit:+confirm"]
    for method, row in rows.items():
        if method == "copy-bound":
            assert "breakdown_ms" not in row
            continue
        assert row["checks"] == ["bitwise ok"], (method, row)
        b = row["breakdown_ms"]
        phases = ("check", "post", "signal", "enqueue", "observe", "ack", "after")
        assert all(b[p] >= 0 for p in phases), b  # one monotonic clock in both processes
        assert b["total"] >= b["check"] + b["post"] and b["total"] <= row["ms"] * 1.01 + 1, (b, row["ms"])
        assert not any(k.startswith("device_") for k in b)  # device phases: CUDA only
    out = capsys.readouterr().out
    assert "Where a refit step's time goes" in out and "| tiny-llama | refit:foreach |" in out
    assert "Breakdown columns" in open(prefix + ".md").read()


def test_breakdown_splits_a_step_into_phases():
    train = StepTrace({"start": 1.0, "checked": 1.001, "posted": 1.0011, "done_seen": 1.010, "end": 1.0101})
    gen = StepTrace({"start": 0.999, "ready_seen": 1.0012, "enqueue_begin": 1.0012, "enqueued": 1.0022,
                     "gpu_done_seen": 1.0098, "done_posted": 1.0099},
                    {"wait": 0.1, "contiguous": 6.0, "strided": 1.5, "batched": 0.1, "copies": 7.6})
    b = breakdown(train, gen)
    assert round(b["total"], 3) == 10.1 and round(b["check"], 3) == 1.0 and round(b["signal"], 3) == 0.1
    assert round(b["enqueue"], 3) == 1.0 and b["device_strided"] == 1.5 and b["device_copies"] == 7.6
    assert round(b["observe"], 3) == 0.9 and round(b["tail"], 3) == 1.1 and round(b["ack"], 3) == 0.2


def test_a_shape_that_does_not_fit_runs_as_a_slice_or_is_skipped_and_the_run_goes_on(tmp_path):
    """``--memory-gib``: the budget (on a GPU, its memory); a shape over it runs as fewer layers, named so,
    and one of which not one layer fits is skipped with a one-line reason, without stopping the run."""
    prefix = str(tmp_path / "fit")
    budget_gib = 2 + 6.5e6 / (1 << 30)  # 2 GiB of fixed needs + 6.5 MB: one of tiny-qwen3-moe's two layers
    rc = main(["--device", "cpu", "--models", "llama-3-8b-shape,tiny-qwen3-moe", "--methods", "copy-bound,refit",
               "--iters", "1", "--warmup", "0", "--timeout-s", "60", "--bound-gib", "0.001",
               "--memory-gib", str(budget_gib), "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0, report
    assert {(r["model"], r["method"]) for r in report["rows"]} == {("tiny-qwen3-moe[1/2 layers]", m)
                                                                   for m in ("copy-bound", "refit")}
    refit = next(r for r in report["rows"] if r["method"] == "refit")
    assert refit["checks"] == ["bitwise ok"]
    (reason,) = report["skipped"]
    assert reason.startswith("skipped llama-3-8b-shape: even one layer needs")
    assert reason in open(prefix + ".md").read()
