"""A round as one rank runs it: its messages resolved onto local memory, direct or staged, and its staging buffers."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from refit_core.contract.spec import Quantization, contiguous_strides, dtype_size
from refit_core.plan.items import Message, Segment
from refit_core.run.copies import StagingCopies
from refit_core.run.copy_merging import Strided
from refit_core.run.lanes import Lane
from refit_core.run.merge import Deltas, MergeBatch
from refit_core.run.quant.boxes import QuantBatch


@dataclass(frozen=True)
class StagedSegment:
    """A segment of a staged message, laid out in the staging buffer at ``offset`` (bytes)."""

    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    quant: Quantization | None = None
    """Set on a sender segment quantized in the pack step: its scales sit at ``scales_offset``."""
    scales_offset: int = 0


@dataclass(frozen=True)
class Post:
    """One message of a round on this rank: the peer (global rank) and where its bytes are.

    ``direct`` is the local memory sent or received straight (zero-copy); when it is None the
    message is staged at ``staging_offset`` of the round's staging buffer.
    """

    peer: int
    nbytes: int
    direct: torch.Tensor | None = None
    staging_offset: int = 0


@dataclass
class RoundPlan:
    """One round on this rank: its messages, and the copies between staging buffer and local views."""

    posts: list[Post] = field(default_factory=list)
    staged_bytes: int = 0
    segments: list[StagedSegment] = field(default_factory=list)
    views: list[torch.Tensor] = field(default_factory=list)
    """The local views of ``segments`` (sources or destinations), in the same order."""
    local: list[Strided] = field(default_factory=list)
    """The layouts of ``views``, in the same order."""
    planned: list[Segment] = field(default_factory=list)
    """The schedule's segments of ``segments`` (their pieces and boxes), in the same order."""
    direct_pieces: set[int] = field(default_factory=set)
    """Pieces this round's direct messages read or write (receives land in them as they arrive)."""
    staged_pieces: set[int] = field(default_factory=set)
    """Pieces this round's staged messages are unpacked into (or packed from)."""
    quantization: QuantBatch | None = None
    """A sender round's quantized segments, as one batch (None: nothing is quantized)."""
    copies: StagingCopies | None = None
    """The plain copies between ``views`` and the staging buffer (None: none, or not planned)."""
    merges: MergeBatch | None = None
    """A sender round's LoRA-merged segments (merged mode; None: none)."""

    def pairs(self, buffer: torch.Tensor | None) -> list[tuple[int, torch.Tensor]]:
        """``(peer, tensor)`` of every message for the transport; ``buffer`` is None when nothing is staged."""
        if buffer is None:
            return [(p.peer, p.direct) for p in self.posts if p.direct is not None]
        return [(p.peer, p.direct if p.direct is not None else buffer[p.staging_offset:p.staging_offset + p.nbytes])
                for p in self.posts]


class StagingBuffers:
    """A step's ``count`` staging buffers of ``nbytes`` each, each allocated when a round first uses it."""

    def __init__(self, lane: Lane, nbytes: int, device: torch.device, count: int) -> None:
        self.lane, self.nbytes, self.device = lane, nbytes, device
        self._slots: list[torch.Tensor | None] = [None] * count

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, slot: int) -> torch.Tensor:
        buffer = self._slots[slot]
        if buffer is None:
            buffer = self._slots[slot] = self.lane.allocate(self.nbytes, self.device)
        return buffer


def buffer_views(buffer: torch.Tensor, segments: Sequence[StagedSegment]) -> list[torch.Tensor]:
    """Typed, shaped views of ``buffer`` for staged segments."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for seg in segments:
        flat = typed.get(seg.dtype)
        if flat is None:
            flat = typed[seg.dtype] = buffer.view(seg.dtype)
        views.append(flat.as_strided(seg.sizes, seg.strides, seg.offset // dtype_size(seg.dtype)))
    return views


def pack(buffer: torch.Tensor, plan: RoundPlan, deltas: Deltas | None = None) -> None:
    """Copy (casting) every plain source into its segment of ``buffer``; quantize the quantized ones;
    merge the LoRA-adapted ones (merged mode, with the step's ``deltas``)."""
    if plan.copies is not None:
        plan.copies.run(buffer)
    if plan.quantization is not None:
        plan.quantization.run(buffer)
    if plan.merges is not None:
        plan.merges.run(buffer, deltas)


def direct_span(views: Sequence[Strided], segments: Sequence[Segment], nbytes: int, *,
                gaps_allowed: bool) -> int | None:
    """Where in their one storage (a byte offset) the segments' local ``views`` hold exactly the message
    of ``nbytes``, or None.

    That is so when every segment's view is contiguous, of the wire dtype, in one storage, and sits
    at the same distance from the first as in the message. A receiver must not write the alignment
    gaps between segments (they may be other weights), so it also needs a gap-free message; a sender
    merely reads gap bytes, so it may allow them. (The span may still lie outside the storage:
    :func:`region_of` checks that.)
    """
    if not views:
        return None
    first = views[0]
    start = first.address - segments[0].offset
    expected = 0
    for view, seg in zip(views, segments):
        if view.dtype != seg.dtype or not view.contiguous or view.device != first.device:
            return None
        if view.storage != first.storage:
            return None
        if view.address - start != seg.offset or (not gaps_allowed and seg.offset != expected):
            return None
        expected = seg.offset + seg.nbytes
    if expected != nbytes:
        return None
    return start - first.storage


def region_of(base: torch.Tensor, begin: int, nbytes: int) -> torch.Tensor | None:
    """A flat uint8 tensor over ``nbytes`` of ``base``'s storage from byte ``begin``; None if outside it."""
    storage = base.untyped_storage()
    if begin < 0 or begin + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=base.device).set_(storage, begin, (nbytes,), (1,))


def direct_region(views: Sequence[torch.Tensor], segments: Sequence[Segment], nbytes: int, *,
                  gaps_allowed: bool) -> torch.Tensor | None:
    """A flat uint8 tensor over local memory whose bytes are exactly the message, or None
    (:func:`direct_span` of the views' layouts)."""
    begin = direct_span([Strided.of(v) for v in views], segments, nbytes, gaps_allowed=gaps_allowed)
    return None if begin is None else region_of(views[0], begin, nbytes)


def pieces_of(m: Message, parts: tuple[tuple[int, int], ...],
              segs: tuple[Segment, ...]) -> list[tuple[int, int, tuple[Segment, ...]]]:
    """``(start, end, segments)`` of ``m`` (its wire ``parts``) that this side lands or sends alone: each
    part whose segments lie within it (offsets from its start), or the whole message when a segment carries
    scales into the next part (a quantizing sender packs it whole) or would straddle two parts."""
    if len(parts) == 1 or any(seg.scales is not None for seg in segs):
        return [(0, m.nbytes, segs)]
    out = []
    for start, end in parts:
        inside = tuple(seg for seg in segs if start <= seg.offset < end)
        if any(seg.offset + seg.nbytes > end for seg in inside):
            return [(0, m.nbytes, segs)]
        out.append((start, end, tuple(dataclasses.replace(seg, offset=seg.offset - start) for seg in inside)))
    return out


_strides_of = functools.lru_cache(maxsize=4096)(contiguous_strides)  # a plan repeats a few box sizes many times


def staged(seg: Segment, base: int) -> StagedSegment:
    """Where ``seg`` sits in a staging buffer whose message starts at ``base``: contiguous, at its wire offset."""
    sizes = seg.box.sizes
    if seg.scales is None:
        return StagedSegment(seg.dtype, sizes, _strides_of(sizes), base + seg.offset)
    return StagedSegment(seg.dtype, sizes, _strides_of(sizes), base + seg.offset, seg.scales.quant,
                         base + seg.scales.offset)


def staged_layout(seg: StagedSegment, buffer: Strided) -> Strided:
    """Where ``seg`` sits in staging buffer ``buffer`` (the layout of what :func:`buffer_views` makes of it)."""
    size = dtype_size(seg.dtype)
    return Strided(buffer.storage, seg.offset // size, seg.sizes, seg.strides, seg.dtype, size, buffer.device)


__all__ = ["Post", "RoundPlan", "StagedSegment", "StagingBuffers", "buffer_views", "direct_region", "direct_span",
           "pack", "pieces_of", "region_of", "staged", "staged_layout"]
