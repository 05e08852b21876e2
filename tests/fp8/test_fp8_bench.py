"""The FP8 part of ``refit bench`` on CPU (gloo, tiny shapes): BF16 refit, FP8 refit and BF16 refit +
quantize-after side by side, every FP8 value and scale checked bitwise on the receiver."""

from __future__ import annotations

import json

from refit_core.kit.models import PRESETS


def test_fp8_bench_smoke_on_cpu(tmp_path):
    from refit_core.tools.bench import main

    config = dict(PRESETS["tiny-qwen3-moe"], dtype="bfloat16")
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    prefix = str(tmp_path / "out")
    rc = main(["--device", "cpu", "--models", f"{path}", "--methods", "wire,refit", "--fp8-block", "32,32",
               "--warmup", "1", "--iters", "1", "--min-iters", "1", "--bucket-mib", "1", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0
    (comparison,) = report["fp8"]
    assert 0.5 < comparison["bytes_ratio"] < 0.65  # embeddings and norms stay BF16
    assert comparison["fp8_refit_checks"] == comparison["fp8_refit-quantize-after_checks"] == ["bitwise ok"]
    assert comparison["bf16_refit_checks"] == ["bitwise ok"]
    assert comparison["fp8_wire_checks"] == ["checksum ok"]
    for key in ("fp8_speedup_vs_bf16_refit", "fp8_speedup_vs_quantize_after"):
        assert comparison[key] > 0
    for key in ("fp8_refit_ratio_to_wire", "quantize_after_ratio_to_bf16_wire"):  # same payload: a time ratio
        assert comparison[key + "_check"]["value"] > 0
    fp8_rows = {r["method"]: r for r in report["models"][1]["rows"]}
    assert fp8_rows["refit-quantize-after"]["bytes"] == report["models"][0]["model_bytes"]  # it moves BF16
    assert "## FP8 destinations" in open(prefix + ".md").read()
