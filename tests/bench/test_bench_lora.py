"""``refit bench --lora`` on CPU at a tiny size: the three methods land every byte, their bytes per step are
what LoRA says (adapter a fraction of the model, merged the whole model), and the wire of the adapter's
bytes is the adapter row's reference."""

from refit_core import LoraSpec
from refit_core.run.merge import time_merge
from refit_core.tools.bench.lora import run


def test_lora_bench_on_cpu_checks_every_method_bitwise():
    lora = LoraSpec.parse("r=8,targets=q,k,v,o,gate,up,down")
    bench = run("tiny-llama", lora, device="cpu", warmup=1, iters=1, bucket_bytes=1 << 20, timeout_s=120,
                merge_repeats=1)
    rows = dict(bench.rows)
    assert rows.pop("wire")["check"] == "checksum ok"
    assert all(row["check"] == "bitwise ok" for row in rows.values()), rows
    per_layer = 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 256) * 3)
    assert rows["adapter"]["bytes"] == 2 * per_layer * 4
    assert rows["merged"]["bytes"] == rows["full"]["bytes"] > 10 * rows["adapter"]["bytes"]
    assert bench.merge_cpu_s > 0
    text = bench.table()
    assert "| adapter |" in text and "merge on the CPU, the whole model once" in text
    assert "of the wire on its own bytes" in text


def test_time_merge_reports_a_positive_time():
    timing = time_merge(64, 32, 4, repeats=1)
    assert timing.seconds > 0 and timing.gbps > 0 and "64x32 bfloat16 box at r=4" in timing.line()
