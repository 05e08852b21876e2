"""What a quantizing pack step works on: the boxes to quantize and the batch that quantizes them.

A leaf of :mod:`refit_core.run.quant`: :mod:`.batched` builds batches of these records and
:mod:`.triton_blocks` (imported only when something is quantized) runs them as Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit_core.contract.spec import Quantization


@dataclass(frozen=True)
class BoxToQuantize:
    """One quantized segment of a staged message: its source box and where its bytes go."""

    source: torch.Tensor
    """The high-precision box (a view of a local weight), whole quantization blocks only."""
    quant: Quantization
    values_offset: int
    """Byte offset of the FP8 values (the box's shape) in the staging buffer, or their address."""
    scales_offset: int
    """Byte offset of the scales (``quant.scale_shape``) in the staging buffer, or their address."""
    values_strides: tuple[int, int] | None = None
    """Element strides of the values seen as ``[G, R, C]`` along G and R (C's is 1); None: contiguous."""
    scales_strides: tuple[int, int, int] | None = None
    """Element strides of the scales seen as ``[G, R/bn, C/bk]``; None: contiguous."""

    @classmethod
    def into_tensors(cls, source: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                     quant: Quantization) -> BoxToQuantize:
        """A box quantized straight into ``values`` and ``scales`` (2-D or 3-D, any strides but a
        contiguous last dimension of ``values``); its offsets are addresses."""
        if values.ndim not in (2, 3) or values.stride(-1) != 1:
            raise ValueError(f"{quant.scale_name}: values of shape {tuple(values.shape)} and strides "
                             f"{values.stride()} need 2 or 3 dims and a contiguous last one")
        values_3d = values if values.ndim == 3 else values.unsqueeze(0)
        scales_3d = scales if scales.ndim == 3 else scales.unsqueeze(0)
        g, r, c = scales_3d.stride()
        return cls(source, quant, values.data_ptr(), scales.data_ptr(), (values_3d.stride(0), values_3d.stride(1)),
                   (g, r, c))


class QuantBatch:
    """Quantizes a fixed list of boxes into a staging buffer (any buffer of the round's layout)."""

    def run(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def warm_up(self, warmed: set[object]) -> None:
        """Compile what :meth:`run` needs (at setup, so that no step waits for a compiler), skipping
        the kinds in ``warmed`` and adding its own."""


__all__ = ["BoxToQuantize", "QuantBatch"]
