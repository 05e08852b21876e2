"""The sender's batched quantizer: one Triton launch for many boxes, checked on CPU through Triton's
interpreter (addressing, block grid, scales), and bit for bit with the hardware's rounding on CUDA
in ``tests/gpu/test_fp8_gpu.py``.

Triton's CPU interpreter rounds float -> FP8 differently from the hardware (ties away from zero, and
values that round up into the next binade come out wrong), so the CPU test feeds blocks whose
quantized values are exact FP8 numbers: every value is an FP8 number times a power of two and every
block holds +-448 times that power, so no rounding happens and the bits must match the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from batch_cases import batch_boxes, box_results

from tests.environments import require
from refit_core.apps import same_bytes
from refit_core.run.quant.batched import BoxByBox, quantize_batch
from refit_core.run.quant.fast import Quantizer
from refit_core.run.quant.reference import reference_quantize

triton = require("triton")


def test_on_cpu_every_box_is_quantized_box_by_box_and_matches_the_reference():
    boxes, nbytes = batch_boxes(lambda shape: torch.randn(shape, dtype=torch.bfloat16))
    batch = quantize_batch(boxes, Quantizer())
    assert isinstance(batch, BoxByBox)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    batch.run(buffer)
    for box in boxes:
        values, scales = box_results(buffer, box)
        want_values, want_scales = reference_quantize(box.source, box.quant)
        assert same_bytes(values, want_values) and same_bytes(scales, want_scales), box.quant


INTERPRETED = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, "tests/fp8")
    from refit_core.kit import same_bytes
    from refit_core.run.quant.reference import reference_quantize
    from refit_core.run.quant.boxes import BoxToQuantize
    from refit_core.run.quant.triton_blocks import GroupKey, TritonBlockBatch, vector_aligned
    from batch_cases import batch_boxes, box_results, strided_targets

    torch.manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    exact = codes[codes.isfinite()]

    def make(shape):
        picks = exact[torch.randint(len(exact), shape)]
        picks.view(-1)[::97] = 448.0  # every block of the cases holds the maximum
        return (picks * 2.0 ** torch.randint(-6, 6, ()).item()).to(torch.bfloat16)

    boxes, nbytes = batch_boxes(make)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    kinds = {(b.quant.block[-2:], vector_aligned(b)) for b in boxes}
    assert {aligned for _, aligned in kinds} == {True, False}, kinds  # both kernel variants run
    for (bn, bk), aligned in kinds:
        members = [b for b in boxes if (b.quant.block[-2:], vector_aligned(b)) == ((bn, bk), aligned)]
        TritonBlockBatch(members, GroupKey(torch.bfloat16, torch.float8_e4m3fn, bn, bk, aligned)).run(buffer)
    for box in boxes:
        values, scales = box_results(buffer, box)
        want_values, want_scales = reference_quantize(box.source, box.quant)
        assert same_bytes(scales, want_scales), ("scales", box.quant)
        assert same_bytes(values, want_values), ("values", box.quant)
    for source, values, scales, quant in strided_targets(make):  # straight into slices of engine tensors
        box = BoxToQuantize.into_tensors(source, values, scales, quant)
        TritonBlockBatch([box], GroupKey(torch.bfloat16, quant.dtype, 128, 128, vector_aligned(box))).run_at_addresses()
        want_values, want_scales = reference_quantize(source, quant)
        assert same_bytes(scales, want_scales), ("scales", quant)
        assert same_bytes(values, want_values), ("values", quant)
    print("interpreted ok", len(boxes))
""")


def test_triton_kernel_under_the_interpreter_writes_every_block_where_the_plan_says():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreted ok 4" in run.stdout
