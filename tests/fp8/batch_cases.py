"""Boxes for the batched quantizer's tests: strided slices, clipped edge blocks, stacked experts."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from refit_core.contract.spec import Quantization
from refit_core.run.quant.boxes import BoxToQuantize


def batch_boxes(make: Callable[[tuple[int, ...]], torch.Tensor]) -> tuple[list[BoxToQuantize], int]:
    """Boxes of tensors from ``make(shape)`` laid out one after another (16-byte aligned), and the
    buffer bytes they need."""
    whole = make((300, 520))
    experts = make((3, 260, 200))
    wide = make((128, 1024))
    sources = [
        (whole[128:300, 128:520], Quantization.block_fp8("a_scale_inv")),  # strided, clipped blocks
        (experts, Quantization.block_fp8("b_scale_inv", experts=True)),
        (wide[:, 256:], Quantization.block_fp8("c_scale_inv")),
        (make((64, 96)), Quantization.block_fp8("d_scale_inv", (32, 32))),
    ]
    boxes, offset = [], 0
    for source, quant in sources:
        values = offset
        scales = _align(values + source.numel())
        offset = _align(scales + math.prod(quant.scale_shape(tuple(source.shape))) * 4)
        boxes.append(BoxToQuantize(source, quant, values, scales))
    return boxes, offset


def box_results(buffer: torch.Tensor, box: BoxToQuantize) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``box`` as the batch wrote them into ``buffer``."""
    shape = tuple(box.source.shape)
    scale_shape = box.quant.scale_shape(shape)
    values = buffer[box.values_offset:box.values_offset + math.prod(shape)].view(box.quant.dtype).view(shape)
    scales = buffer[box.scales_offset:box.scales_offset + 4 * math.prod(scale_shape)].view(torch.float32)
    return values, scales.view(scale_shape)


def _align(n: int) -> int:
    return -(-n // 16) * 16


def strided_targets(make: Callable[[tuple[int, ...]], torch.Tensor]
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Quantization]]:
    """``(source, values, scales, quant)`` whose destinations are slices of bigger FP8 / fp32 tensors
    (the up half of a fused gate/up expert weight, a column slice): the quantize-after baseline's case."""
    fused = torch.zeros(3, 520, 256, dtype=torch.float8_e4m3fn, device=make((1,)).device)
    fused_scales = torch.zeros(3, 6, 2, device=fused.device)
    wide = torch.zeros(256, 512, dtype=torch.float8_e4m3fn, device=fused.device)
    wide_scales = torch.zeros(2, 4, device=fused.device)
    return [(make((3, 260, 256)), fused[:, 260:], fused_scales[:, 3:], Quantization.block_fp8("e", experts=True)),
            (make((256, 256)), wide[:, 256:], wide_scales[:, 2:], Quantization.block_fp8("w"))]
