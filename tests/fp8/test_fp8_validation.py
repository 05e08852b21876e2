"""Bind-time view checks (issue #11) on quantized destinations: an FP8 weight's view must still be
float8 of its box's shape, its scale view fp32, and the two may share a storage but not a byte."""

from __future__ import annotations

import pytest
import torch

from refit_core.contract.spec import Box, Quantization, TensorSpec
from refit_core.run.validate import ViewError, check_no_overlap, check_view

NAME = "model.layers.0.mlp.down_proj.weight"
QUANT = Quantization.block_fp8(NAME + "_scale_inv")
VALUES = TensorSpec(NAME, (256, 256), torch.float8_e4m3fn, QUANT)
SCALES = QUANT.scale_spec(VALUES.shape)
BOX = Box((128, 0), (128, 256))


def test_fp8_values_and_fp32_scales_pass():
    values = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(SCALES.shape, dtype=torch.float32)
    check_view(VALUES, BOX, BOX.slice_of(values), destination=True)
    check_view(SCALES, QUANT.scale_box(BOX), QUANT.scale_box(BOX).slice_of(scales), destination=True)


@pytest.mark.parametrize("view,words", [
    (torch.zeros(128, 256, dtype=torch.bfloat16), "view dtype torch.bfloat16 != spec dtype torch.float8_e4m3fn"),
    (torch.zeros(128, 256, dtype=torch.float8_e5m2), "view dtype torch.float8_e5m2"),
    (torch.zeros(128, 128, dtype=torch.float8_e4m3fn), "view shape (128, 128) != box sizes (128, 256)"),
    (torch.zeros(1, 256, dtype=torch.float8_e4m3fn).expand(128, 256), "stride-0"),
], ids=["re-materialized-bf16", "e5m2", "shape", "expanded"])
def test_a_changed_fp8_view_is_refused_naming_the_tensor(view, words):
    with pytest.raises(ViewError, match=NAME) as info:
        check_view(VALUES, BOX, view, destination=True)
    assert words in str(info.value)


def test_a_scale_view_of_the_wrong_dtype_is_refused():
    box = QUANT.scale_box(BOX)
    with pytest.raises(ViewError, match="weight_scale_inv: view dtype torch.bfloat16"):
        check_view(SCALES, box, torch.zeros(box.sizes, dtype=torch.bfloat16), destination=True)


def test_values_and_scales_in_one_buffer_may_not_share_a_byte():
    """An engine packing FP8 values and their fp32 scales into one allocation: neighbours pass, a
    scale view reaching one byte into the values is refused, naming both."""
    buffer = torch.zeros(256 * 256 + 4 * 4, dtype=torch.uint8)
    values = buffer[:256 * 256].view(torch.float8_e4m3fn).view(256, 256)
    scales = buffer[256 * 256:].view(torch.float32).view(2, 2)
    check_no_overlap([VALUES.name, SCALES.name], [values, scales])
    overlapping = buffer[256 * 256 - 4:256 * 256 + 12].view(torch.float32).view(2, 2)
    with pytest.raises(ViewError, match="shares memory") as info:
        check_no_overlap([VALUES.name, SCALES.name], [values, overlapping])
    assert NAME in str(info.value) and SCALES.name in str(info.value)
