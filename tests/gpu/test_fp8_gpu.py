"""GPU tests of FP8 destinations: the compiled CUDA quantizer against the reference, bit for bit, and
a 2-GPU NCCL refit into a block-FP8 destination through ``refit bench --fp8-block``.

Skipped without CUDA (CI has none); ``benchmarks/run_gpu.sh`` runs them on the GPU machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.environments import BY_DESIGN
from refit_core.apps import same_bytes
from refit_core.contract.spec import Quantization
from refit_core.kit.models import PRESETS
from refit_core.run.quant.batched import Batches, quantize_batch
from refit_core.run.quant.boxes import BoxToQuantize
from refit_core.run.quant.fast import Quantizer
from refit_core.run.quant.reference import reference_quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fp8"))
from batch_cases import batch_boxes, box_results, strided_targets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{BY_DESIGN}needs CUDA")]


@pytest.mark.parametrize("quant,shape", [
    (Quantization.block_fp8("s", (128, 128)), (640, 384)),
    (Quantization.block_fp8("s", (128, 128)), (200, 130)),
    (Quantization.block_fp8("s", (128, 128), experts=True), (4, 256, 256)),
])
def test_compiled_cuda_quantizer_matches_the_reference(quant, shape):
    base = torch.randn(shape[0] * 2, *shape[1:], dtype=torch.bfloat16, device="cuda")
    view = base[shape[0]:]  # a strided slice, as the sender reads fused parameters
    values, scales = Quantizer(compiled=True).quantize(view, quant)
    want_values, want_scales = reference_quantize(view, quant)
    assert same_bytes(values, want_values) and same_bytes(scales, want_scales)


def test_compiled_quantizer_writes_fp8_views_of_a_byte_buffer_without_falling_back():
    """The sender's pack step quantizes into FP8 views of its uint8 staging buffer: inductor refuses
    to mutate a view of another dtype, so the compiled function is pure and the copy is eager."""
    quant = Quantization.block_fp8("s", (128, 128))
    x = torch.randn(384, 256, dtype=torch.bfloat16, device="cuda")
    buffer = torch.zeros(384 * 256 + 16 * 3 * 2 * 4, dtype=torch.uint8, device="cuda")
    values = buffer[:384 * 256].view(quant.dtype).view(384, 256)
    scales = buffer[384 * 256:384 * 256 + 3 * 2 * 4].view(torch.float32).view(3, 2)
    quantizer = Quantizer(compiled=True)
    quantizer.quantize_into(x, values, scales, quant)
    want_values, want_scales = reference_quantize(x, quant)
    assert same_bytes(values, want_values) and same_bytes(scales, want_scales)
    from refit_core.run.quant.fast import quantized_3d
    assert quantizer._kernel is not quantized_3d, "the compiled quantizer fell back to eager"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_triton_quantizer_matches_the_reference_bitwise(dtype):
    """The sender's pack step: every quantized box of a round in one launch per block size."""
    boxes, nbytes = batch_boxes(lambda shape: torch.randn(shape, dtype=dtype, device="cuda") * 3)
    batch = quantize_batch(boxes, Quantizer(compiled=False))
    assert isinstance(batch, Batches) and {type(p).__name__ for p in batch.parts} == {"TritonBlockBatch"}
    batch.warm_up(set())
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    batch.run(buffer)
    for box in boxes:
        values, scales = box_results(buffer, box)
        want_values, want_scales = reference_quantize(box.source, box.quant)
        assert same_bytes(values, want_values), box.quant
        assert same_bytes(scales, want_scales), box.quant


def test_batched_triton_quantizer_writes_slices_of_engine_tensors_bitwise():
    """The quantize-after baseline quantizes into slices of fused FP8 parameters, by address."""
    from refit_core.run.quant.triton_blocks import TritonBlockBatch, group_key

    for source, values, scales, quant in strided_targets(
            lambda shape: torch.randn(shape, dtype=torch.bfloat16, device="cuda")):
        box = BoxToQuantize.into_tensors(source, values, scales, quant)
        key = group_key(box)
        assert key is not None
        TritonBlockBatch([box], key).run_at_addresses()
        want_values, want_scales = reference_quantize(source, quant)
        assert same_bytes(values, want_values) and same_bytes(scales, want_scales)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"{BY_DESIGN}needs 2 CUDA GPUs")
def test_fp8_bench_on_two_gpus_is_bitwise(tmp_path):
    from refit_core.tools.bench import main

    config = dict(PRESETS["tiny-qwen3-moe"], hidden_size=512, moe_intermediate_size=256, num_experts=16,
                  head_dim=128, dtype="bfloat16")
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    prefix = str(tmp_path / "out")
    rc = main(["--models", f"tiny-llama,{path}", "--methods", "wire,refit", "--fp8-block", "128,128",
               "--train-gpus", "0", "--gen-gpus", "1", "--warmup", "1", "--iters", "2", "--min-iters", "1",
               "--out", prefix])
    assert rc == 0
    report = json.loads(open(prefix + ".json").read())
    for comparison in report["fp8"]:
        assert comparison["fp8_refit_checks"] == ["bitwise ok"], comparison
        assert comparison["fp8_refit-quantize-after_checks"] == ["bitwise ok"], comparison


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_colocated_fp8_on_one_gpu_quantizes_in_batched_launches_bitwise(block):
    """Trainer and engine share cuda:0 (CUDA IPC): the segments the plan quantizes on the sender are
    quantized by the engine's process straight from the trainer's memory, one batched Triton launch
    per kernel variant (not one per segment), every FP8 weight and scale bitwise equal to the
    reference quantizer's over two steps."""
    from fp8_ranks import fp8_refit_rank

    from refit_core.kit.launch import free_port, spawn

    job = {"model": "tiny-llama", "train_tp": 1, "gen_tp": 1, "block": block, "config": {"dtype": "bfloat16"},
           "device": "cuda:0", "options": {"colocate": "shared"}}
    train, gen = spawn(fp8_refit_rank, 2, f"127.0.0.1:{free_port()}", job, timeout_s=300)
    assert "error" not in gen and gen["mismatches"] == [] and gen["version"] == 1, gen
    assert train["quantized_segments"] >= 8, train  # every layer's projections: whole blocks at these sizes
    assert 1 <= gen["colocated_quantize_launches"] <= 2, gen  # one per kernel variant (aligned or not)
