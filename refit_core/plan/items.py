"""The plan's records: transfers (what moves), and the messages they are cut into, with their segments.

The planners (:mod:`refit_core.plan.reference`, :mod:`refit_core.plan.fast`) make :class:`Transfer`\\ s;
:mod:`refit_core.plan.schedule` lays them out as :class:`Message`\\ s of :class:`Segment`\\ s, each segment
starting at a multiple of :data:`ALIGN` bytes of its message; the executors read those records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit_core.contract.records import unchecked
from refit_core.contract.spec import Box, Quantization, QuantizeStep, QuantSite, dtype_size

ALIGN = 16
"""Every message and staging slice starts at a multiple of this many bytes (the message layout's only
rule; :class:`~refit_core.contract.options.RefitOptions` checks ``bucket_bytes`` against it)."""


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Transfer:
    """One region moving from a train rank to a gen rank.

    Boxes are relative to the source and destination pieces; both have the same sizes.
    ``dtype`` is the wire dtype (the destination's: the sender casts; for a tensor quantized on the
    receiver, the source's). ``quantize`` is set for a quantized destination fed by high-precision
    weights (None: a plain copy or cast).
    """

    name: str
    src: int
    src_piece: int
    src_box: Box
    dst: int
    dst_piece: int
    dst_box: Box
    dtype: torch.dtype
    quantize: QuantizeStep | None = None

    @property
    def nbytes(self) -> int:
        values = self.src_box.numel * dtype_size(self.dtype)
        if self.quantize is not None and self.quantize.site is QuantSite.SENDER:
            return values + self.quantize.quant.scale_nbytes(self.dst_box.sizes)
        return values


@dataclass(frozen=True)
class SegmentScales:
    """A sender segment that quantizes: its scales travel at byte ``offset`` of the message."""

    quant: Quantization
    offset: int

    def shape(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return self.quant.scale_shape(sizes)


@dataclass(frozen=True)
class Segment:
    """``box`` of local piece ``piece`` travels at byte ``offset`` of its message, as ``dtype``.

    ``scales`` is set on a sender's segment that is quantized in the pack step: ``dtype`` is then
    the FP8 dtype of the values, and the scales of the box's blocks follow at ``scales.offset``
    (the receiver sees two plain segments: the values, and the scales into the scale piece).
    """

    piece: int
    box: Box
    offset: int
    dtype: torch.dtype
    scales: SegmentScales | None = None

    @property
    def nbytes(self) -> int:
        return self.box.numel * dtype_size(self.dtype)


@dataclass(frozen=True)
class ReceiverQuantization:
    """Gen rank ``dst`` quantizes its piece ``piece`` (received in high precision) into itself and
    the scale piece ``scale_piece`` after every step's bytes landed."""

    dst: int
    piece: int
    scale_piece: int
    quant: Quantization
    dtype: torch.dtype
    """The high-precision dtype the piece's bytes arrive in (the source's)."""


@dataclass(frozen=True)
class Message:
    """One contiguous buffer from train rank ``src`` to gen rank ``dst`` (side-local ranks).

    A message that carries scales (a sender quantizes its segments) lays every segment's values first
    and all their scales after them, from :attr:`scales_at` on, and travels as two operations, values
    then scales: a receiver can land each part straight in its tensor (the FP8 weight, its scales).
    ``dst_segments`` keeps the order of ``src_segments``, a quantized one's scales right after its values.
    """

    src: int
    dst: int
    nbytes: int
    src_segments: tuple[Segment, ...]
    dst_segments: tuple[Segment, ...]

    @property
    def scales_at(self) -> int:
        """Where the scales section starts (0: the message carries no scales and travels whole)."""
        return min((s.scales.offset for s in self.src_segments if s.scales is not None), default=0)

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        """The ``(start, end)`` bytes of each operation the message travels as, in order (both ends
        derive them from the message alone)."""
        at = self.scales_at
        return ((0, at), (at, self.nbytes)) if at else ((0, self.nbytes),)


new_transfer = unchecked(Transfer)
"""A :class:`Transfer` from known-good fields (:func:`~refit_core.contract.records.unchecked`): the fast
planner stamps millions."""
new_segment = unchecked(Segment)
"""A :class:`Segment` from known-good fields: schedules at scale hold a million of them."""
