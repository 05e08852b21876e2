"""The reference quantizer: plain torch, one block at a time. Slow; the tests' ground truth.

For each block: ``amax = max |x|`` in fp32, ``scale = max(amax, EPS) / FP8_MAX``,
``values = clamp(x * (FP8_MAX / max(amax, EPS)), -FP8_MAX, FP8_MAX)`` rounded to the FP8 dtype.
Multiplying by a per-block reciprocal (instead of dividing every element) and dividing in fp64
(then rounding to fp32, which equals the correctly rounded fp32 quotient: 53 >= 2 x 24 + 2 bits)
is what lets the fast quantizer match this bit for bit on every device: multiplies and fp64
divides round the same everywhere, while compiled GPU kernels divide fp32 approximately.
"""

from __future__ import annotations

import itertools

import torch

from refit_core.contract.spec import EPS, Quantization


def block_scale_and_reciprocal(amax: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, reciprocal)`` (fp32) of blocks with absolute maxima ``amax``: correctly rounded
    fp32 quotients, computed in fp64 so that compiled kernels get the same bits."""
    clamped = amax.float().clamp(min=EPS).double()
    return (clamped / fp8_max).float(), (fp8_max / clamped).float()


def reference_quantize(x: torch.Tensor, quant: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of a whole tensor ``x``, computed block by block."""
    shape = tuple(x.shape)
    values = torch.empty(shape, dtype=quant.dtype, device=x.device)
    scales = torch.empty(quant.scale_shape(shape), dtype=quant.scale_dtype, device=x.device)
    for index in itertools.product(*(range(n) for n in scales.shape)):
        region = tuple(slice(i * b, min((i + 1) * b, n)) for i, b, n in zip(index, quant.block, shape))
        block = x[region].float()
        scale, reciprocal = block_scale_and_reciprocal(block.abs().max(), quant.fp8_max)
        scales[index] = scale
        values[region] = (block * reciprocal).clamp(-quant.fp8_max, quant.fp8_max).to(quant.dtype)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, quant: Quantization) -> torch.Tensor:
    """fp32 ``values * scale`` of each block (for accuracy checks)."""
    expanded = scales
    for dim, b in enumerate(quant.block):
        expanded = expanded.repeat_interleave(b, dim=dim).narrow(dim, 0, values.shape[dim])
    return values.float() * expanded
