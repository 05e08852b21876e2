"""The quantizer refit runs: whole tensors (or block-aligned boxes) at once.

Same arithmetic as :mod:`.reference`, vectorized. A box is seen as ``[G, R, C]`` (leading dims
flattened: their block size is 1) and viewed as ``[G, R/bn, bn, C/bk, bk]`` (zero-padded where a
block is clipped): block maxima are one reduction, scales a few ops on the small block grid, values
one multiply and cast, then copied into the destination. On CUDA that function runs under
``torch.compile`` (one compile per block shape and dtype, dynamic in the tensor's shape and strides:
an eager quantizer is slower than the wire); elsewhere, or when compiling fails, it runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from refit_core.contract.spec import Quantization
from refit_core.run.quant.reference import block_scale_and_reciprocal

log = logging.getLogger("refit.quant")

Kernel = Callable[[torch.Tensor, int, int, float, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """``[..., R, C]`` as ``[G, R, C]``, a view (outputs are written through it)."""
    return x.unsqueeze(0) if x.ndim == 2 else x.view(-1, *x.shape[-2:])


def _blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``[G, R, C]`` as ``[G, ceil(R/bn), bn, ceil(C/bk), bk]``, zero-padded to whole blocks."""
    groups, rows, cols = x.shape
    pad_rows, pad_cols = (-rows) % bn, (-cols) % bk
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    return x.reshape(groups, (rows + pad_rows) // bn, bn, (cols + pad_cols) // bk, bk)


def quantized_3d(x: torch.Tensor, bn: int, bk: int, fp8_max: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x`` ``[G, R, C]``: FP8 ``values`` of ``x``'s shape and ``scales``
    ``[G, R/bn, C/bk]``. Pure (it writes no input), which is what ``torch.compile`` needs: the
    destinations are often FP8 views of byte buffers, and inductor refuses to mutate a view of
    another dtype."""
    blocks = _blocks(x, bn, bk)
    amax = blocks.abs().amax(dim=(2, 4)).float()
    scale, reciprocal = block_scale_and_reciprocal(amax, fp8_max)
    quantized = (blocks.float() * reciprocal[:, :, None, :, None]).clamp(-fp8_max, fp8_max).to(dtype)
    groups, n_rows, _, n_cols, _ = blocks.shape
    return quantized.reshape(groups, n_rows * bn, n_cols * bk)[:, :x.shape[1], :x.shape[2]], scale


def quantize_3d(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bn: int, bk: int,
                fp8_max: float, kernel: Kernel | None = None) -> None:
    """Quantize ``x`` ``[G, R, C]`` into ``values`` (same shape, FP8) and ``scales`` ``[G, R/bn, C/bk]``
    with ``kernel`` (default: :func:`quantized_3d`, eagerly)."""
    quantized, scale = (kernel or quantized_3d)(x, bn, bk, fp8_max, values.dtype)
    values.copy_(quantized)
    scales.copy_(scale)


RECOMPILES = 64
"""Compiled variants the quantizer may need (2-D / 3-D boxes, padded blocks, stride patterns):
dynamo's default limit of 8 would silently fall back to eager on a large model."""


def _allow_recompiles(limit: int) -> None:
    config = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(config, knob):
            setattr(config, knob, max(getattr(config, knob), limit))


class Quantizer:
    """Quantizes high-precision boxes into FP8 values and scales.

    ``compiled``: True runs :func:`quantized_3d` under ``torch.compile``, False eagerly, None (the
    default) compiles on CUDA only; the results are then copied into the destinations. A compile
    failure falls back to eager, once, with a warning.
    """

    def __init__(self, compiled: bool | None = None) -> None:
        self.compiled = compiled
        self._kernel: Kernel | None = None

    def _pick(self, device: torch.device) -> Kernel:
        if self._kernel is None:
            wanted = self.compiled if self.compiled is not None else device.type == "cuda"
            if wanted:
                _allow_recompiles(RECOMPILES)
            self._kernel = torch.compile(quantized_3d, dynamic=True) if wanted else quantized_3d
        return self._kernel

    def quantize_into(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                      quant: Quantization) -> None:
        """Write the quantization of ``x`` (a block-aligned box) into ``values`` and ``scales``."""
        if any(b != 1 for b in quant.block[:-2]):
            raise ValueError(f"{quant.scale_name}: blocks {quant.block} span leading dims; only the last "
                             "two dims may hold blocks larger than 1")
        bn, bk = quant.block[-2:]
        kernel = self._pick(x.device)
        source = _as_3d(x) if x.ndim <= 3 else x.reshape(-1, *x.shape[-2:])
        args = (source, _as_3d(values), _as_3d(scales), bn, bk, quant.fp8_max)
        if kernel is quantized_3d:
            quantize_3d(*args)
            return
        try:
            quantize_3d(*args, kernel=kernel)
        except Exception as exc:  # noqa: BLE001 - any compiler problem: stay correct, run eagerly
            log.warning("refit: the compiled FP8 quantizer failed (%s: %s); running eagerly",
                        type(exc).__name__, exc)
            self._kernel = quantized_3d
            quantize_3d(*args)

    def quantize(self, x: torch.Tensor, quant: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, scales)`` of ``x`` in fresh tensors."""
        values = torch.empty(tuple(x.shape), dtype=quant.dtype, device=x.device)
        scales = torch.empty(quant.scale_shape(tuple(x.shape)), dtype=quant.scale_dtype, device=x.device)
        self.quantize_into(x, values, scales, quant)
        return values, scales


_DEFAULT: Quantizer | None = None


def default_quantizer() -> Quantizer:
    """The process-wide quantizer (compiled code is cached across calls)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Quantizer()
    return _DEFAULT
