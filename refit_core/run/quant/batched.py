"""Quantize every box of a staged message in one go: the sender's pack step for FP8 destinations.

A round's quantized segments are known at bind time: their sources (views of the trainer's weights)
and where their values and scales sit in the staging buffer. :func:`quantize_batch` turns them into
a :class:`~refit_core.run.quant.boxes.QuantBatch` once; each step then runs it into whichever staging
buffer the round uses.

On CUDA, block schemes whose block sizes are powers of two (block-FP8's 128 x 128) run as one
Triton launch per (source dtype, FP8 dtype, block, alignment) group: one program per block, its segment found
through a per-block index, so there is no per-segment Python or launch cost and the arithmetic is
:mod:`.reference`'s exactly (fp64 scale division, fp32 multiply, round-to-nearest-even cast).
Everything else (CPU, other schemes, no Triton) runs box by box through :class:`.fast.Quantizer`.

:class:`QuantizeInto` runs the same kernel with the engine's own tensors as targets (their addresses
as offsets): a colocated gen rank quantizing straight out of the trainer's memory, and the
benchmark's quantize-after baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from refit_core.contract.spec import Quantization, contiguous_strides
from refit_core.run.quant.boxes import BoxToQuantize, QuantBatch
from refit_core.run.quant.fast import Quantizer

if TYPE_CHECKING:
    from refit_core.run.quant.triton_blocks import TritonBlockBatch


class BoxByBox(QuantBatch):
    """One :class:`.fast.Quantizer` call per box (CPU, and schemes the batched kernel does not take)."""

    def __init__(self, boxes: Sequence[BoxToQuantize], quantizer: Quantizer) -> None:
        self.boxes = list(boxes)
        self.quantizer = quantizer

    def run(self, buffer: torch.Tensor) -> None:
        for box in self.boxes:
            values = _typed(buffer, box.quant.dtype, tuple(box.source.shape), box.values_offset)
            scales = _typed(buffer, box.quant.scale_dtype, box.quant.scale_shape(tuple(box.source.shape)),
                            box.scales_offset)
            self.quantizer.quantize_into(box.source, values, scales, box.quant)

    def warm_up(self, warmed: set[object]) -> None:
        _warm_up_one_by_one(self.quantizer, [(box.source, box.quant) for box in self.boxes], warmed)


def _warm_up_one_by_one(quantizer: Quantizer, work: Sequence[tuple[torch.Tensor, Quantization]],
                        warmed: set[object]) -> None:
    """Compile :class:`.fast.Quantizer`'s kernel for each kind of ``(source, quantization)`` not in ``warmed``."""
    for source, quant in work:
        key = (BoxByBox, quant.block, quant.dtype, source.dtype, source.ndim)
        if key not in warmed:
            warmed.add(key)
            quantizer.quantize(source, quant)


class Batches(QuantBatch):
    """Several batches run one after the other."""

    def __init__(self, parts: Sequence[QuantBatch]) -> None:
        self.parts = list(parts)

    def run(self, buffer: torch.Tensor) -> None:
        for part in self.parts:
            part.run(buffer)

    def warm_up(self, warmed: set[object]) -> None:
        for part in self.parts:
            part.warm_up(warmed)


def _typed(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    return buffer.view(dtype).as_strided(shape, contiguous_strides(shape), offset // dtype.itemsize)


@dataclass(frozen=True)
class TensorsToQuantize:
    """A high-precision ``source`` quantized straight into an engine's ``values`` and ``scales``."""

    source: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor
    quant: Quantization


class QuantizeInto:
    """Quantizes a fixed list of :class:`TensorsToQuantize` into their own tensors, every step: one
    batched launch per kernel variant where the batched kernel applies (the tensors' addresses as
    offsets), :class:`.fast.Quantizer` one by one for the rest (CPU, other schemes and layouts)."""

    def __init__(self, work: Sequence[TensorsToQuantize], quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        self.batches: list[TritonBlockBatch] = []
        self.rest: list[TensorsToQuantize] = []
        if not work:
            return
        boxes = [BoxToQuantize.into_tensors(item.source, item.values, item.scales, item.quant)
                 if item.values.ndim in (2, 3) and item.values.stride(-1) == 1 and item.scales.ndim == item.values.ndim
                 else None for item in work]
        self.batches, rest = _batched_kernels(boxes)
        self.rest = [work[i] for i in rest]

    @property
    def launches(self) -> int:
        """Kernel launches (or quantizer calls) per :meth:`run`."""
        return len(self.batches) + len(self.rest)

    def run(self) -> None:
        for batch in self.batches:
            batch.run_at_addresses()
        for item in self.rest:
            self.quantizer.quantize_into(item.source, item.values, item.scales, item.quant)

    def warm_up(self) -> None:
        """Compile every kernel :meth:`run` uses (at setup, so that no step waits for a compiler)."""
        warmed: set[object] = set()
        for batch in self.batches:
            batch.warm_up(warmed)
        _warm_up_one_by_one(self.quantizer, [(item.source, item.quant) for item in self.rest], warmed)


def _batched_kernels(boxes: Sequence[BoxToQuantize | None]) -> tuple[list[TritonBlockBatch], list[int]]:
    """One batched Triton kernel per variant for the boxes it takes, and the positions of the rest
    (None: a box the caller already knows the kernel cannot take)."""
    from refit_core.run.quant import triton_blocks  # imports Triton only when something is quantized

    groups: dict[triton_blocks.GroupKey, list[BoxToQuantize]] = {}
    rest = []
    for index, box in enumerate(boxes):
        key = None if box is None else triton_blocks.group_key(box)
        if key is None:
            rest.append(index)
        else:
            assert box is not None
            groups.setdefault(key, []).append(box)
    return [triton_blocks.TritonBlockBatch(members, key) for key, members in groups.items()], rest


def quantize_batch(boxes: Sequence[BoxToQuantize], quantizer: Quantizer) -> QuantBatch | None:
    """The batch that quantizes ``boxes`` (None when there are none): batched kernels where they
    apply, box by box for the rest."""
    if not boxes:
        return None
    batches, rest = _batched_kernels(boxes)
    parts: list[QuantBatch] = list(batches)
    if rest:
        parts.append(BoxByBox([boxes[i] for i in rest], quantizer))
    return parts[0] if len(parts) == 1 else Batches(parts)


__all__ = ["Batches", "BoxByBox", "QuantizeInto", "TensorsToQuantize", "quantize_batch"]
