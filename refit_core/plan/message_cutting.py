"""Cutting one pair's transfers into messages: units, sibling experts interleaved, sender-side scales.

A *message* is one contiguous buffer from one train rank to one gen rank: a list of segments laid
out back to back (16-byte aligned). Messages are cut from *units*: the transfers of one pair into one
destination piece (e.g. the eight query-group blocks that make up ``q_proj``), with sibling
grouped-expert tensors of equal shape (``experts.gate_proj`` and ``experts.up_proj``) interleaved
expert by expert. By default (``units``) a unit of at least ``direct_bytes`` gets messages of its own
and smaller units share packed messages of at most ``shared_max_bytes`` (why 64 MiB: docs/benchmarks.md,
"Trainer -> engine over NCCL"). A message whose segments are one contiguous, gap-free run of memory on a
side (a whole parameter, the ``q_proj`` rows of a fused QKV, ``[gate_e; up_e]`` of a stacked ``w13``) is
then sent or received by the executor straight from or into that memory, with no staging copy; each side
decides that alone, since the bytes on the wire are the same either way. A message quantized on the
sender carries its values first and their scales after them, and travels as two operations, so a
receiver lands each straight in its tensor. A pair whose sender quantizes cuts its messages to a quarter
of the bucket (:data:`QUANTIZED_MESSAGE_SHARE`). The interleaving is a guess about memory (expert-major
fused gate/up, as in Megatron's and vLLM's stacked experts); a wrong guess costs a staging copy on that
side, never correctness.

The ``runs`` :class:`~refit_core.contract.options.MessageMode` (benchmarking) instead lays consecutive units of
one kind (*gather* units, fed by several transfers like Megatron's per-group QKV, or *plain* ones) back
to back into messages of up to ``bucket_bytes``: fewer NCCL operations, zero-copy only where neighbouring
parameters are neighbours in memory on a side (one flat parameter buffer), staged everywhere else.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from itertools import groupby
from operator import attrgetter

from refit_core.contract.options import MessageMode, MessageOptions
from refit_core.contract.spec import Box, QuantizeStep, QuantSite, dtype_size
from refit_core.plan.items import (
    ALIGN,
    Message,
    Segment,
    SegmentScales,
    Transfer,
    align,
    new_segment,
)


QUANTIZED_MESSAGE_SHARE = 4
"""A pair whose sender quantizes (in its pack step) forms messages of at most ``bucket_bytes / 4``, so that a
round holds several. With one bucket-sized message per round, the rounds in flight (one per staging buffer)
ran at once on separate communicators and ended together, and the next round's quantizing pack ran with the
link idle; with several, a round's operations queue behind the last round's on each communicator (the
measurements: docs/benchmarks.md, "FP8 engines", 2026-11-27)."""


def _chunks(box: Box, max_numel: int, block: tuple[int, ...] | None = None) -> Iterator[Box]:
    """Sub-boxes of ``box`` (relative offsets) of at most ``max_numel`` elements, in memory order,
    cut only at multiples of ``block`` (quantization blocks; default: anywhere)."""
    if box.numel <= max_numel:
        yield box
        return
    block = block or (1,) * box.ndim
    dim = next((d for d, (s, b) in enumerate(zip(box.sizes, block)) if s > b), None)
    if dim is None:
        raise ValueError(f"a bucket of {max_numel} elements is smaller than one quantization block {block}")
    inner = math.prod(box.sizes[:dim]) * math.prod(box.sizes[dim + 1:]) * block[dim]  # one block's slab
    if inner <= max_numel:
        step = max_numel // inner * block[dim]
        for start in range(0, box.sizes[dim], step):
            size = min(step, box.sizes[dim] - start)
            yield _narrow(box, dim, start, size)
    else:
        for start in range(0, box.sizes[dim], block[dim]):
            yield from _chunks(_narrow(box, dim, start, min(block[dim], box.sizes[dim] - start)), max_numel, block)


def _narrow(box: Box, dim: int, start: int, size: int) -> Box:
    offsets = list(box.offsets)
    sizes = list(box.sizes)
    offsets[dim] += start
    sizes[dim] = size
    return Box(tuple(offsets), tuple(sizes))


def _split_transfer(t: Transfer, max_bytes: int) -> Iterator[tuple[Box, Box]]:
    """Paired (src, dst) sub-boxes of a transfer, each at most ``max_bytes``.

    A transfer quantized on the sender is cut on block boundaries, at most half the bucket of
    values each so that the values, their scales and the alignment gap fit.
    """
    block = None
    max_numel = max(1, max_bytes // dtype_size(t.dtype))
    step = _sender_step(t)
    if step is not None:
        block = step.quant.block
        max_numel = max(1, max_bytes // 2)
    if t.src_box.numel <= max_numel:
        yield t.src_box, t.dst_box
        return
    origin = Box((0,) * t.src_box.ndim, t.src_box.sizes)
    for part in _chunks(origin, max_numel, block):
        yield (Box(tuple(a + b for a, b in zip(t.src_box.offsets, part.offsets)), part.sizes),
               Box(tuple(a + b for a, b in zip(t.dst_box.offsets, part.offsets)), part.sizes))


class _MessageBuilder:
    """Lays segments back to back (16-byte aligned) into messages of at most ``bucket_bytes``; the
    scales of segments quantized on the sender go after every value, at :meth:`close`
    (:class:`~refit_core.plan.items.Message`)."""

    def __init__(self, bucket_bytes: int, out: list[Message]) -> None:
        self.bucket_bytes = bucket_bytes
        self.out = out
        self.src_segs: list[Segment] = []
        self.dst_segs: list[Segment | None] = []
        self.used = 0
        self.pair = (0, 0)
        self.scales: list[tuple[int, int, QuantizeStep, Box]] = []
        """Per quantized segment: its index in ``src_segs``, its scales' index in ``dst_segs``, its step and
        its scale box."""
        self.scale_room = 0
        """The bytes the scales of ``scales`` take after the values (each aligned)."""

    def add(self, t: Transfer, src_box: Box, dst_box: Box, nbytes: int) -> None:
        """Append ``src_box`` -> ``dst_box`` of ``t`` (``nbytes`` of values on the wire; a transfer
        quantized on the sender adds the scales of its blocks to the scales section)."""
        step = _sender_step(t)
        scale_bytes = 0
        if step is not None:
            scale_box = step.quant.scale_box(dst_box)
            scale_bytes = align(scale_box.numel * dtype_size(step.quant.scale_dtype))
        offset = -(-self.used // ALIGN) * ALIGN  # align(), inlined: a million calls at scale
        if align(offset + nbytes) + self.scale_room + scale_bytes > self.bucket_bytes and self.src_segs:
            self.close()
            offset = 0
        if align(nbytes) + scale_bytes > self.bucket_bytes:
            raise ValueError(f"{t.name}: a {nbytes}-byte segment and its scales do not fit the "
                             f"{self.bucket_bytes}-byte bucket")
        self.pair = (t.src, t.dst)
        if step is not None:
            self.scales.append((len(self.src_segs), len(self.dst_segs) + 1, step, scale_box))
            self.scale_room += scale_bytes
            self.src_segs.append(Segment(t.src_piece, src_box, offset, t.dtype))  # its scales are set at close()
            self.dst_segs += (Segment(t.dst_piece, dst_box, offset, t.dtype), None)
        else:
            self.src_segs.append(new_segment(t.src_piece, src_box, offset, t.dtype, None))
            self.dst_segs.append(new_segment(t.dst_piece, dst_box, offset, t.dtype, None))
        self.used = offset + nbytes

    def add_plain(self, t: Transfer, nbytes: int) -> None:
        """:meth:`add` of a whole transfer that is not quantized and fits the bucket (the common case),
        its two segments built unchecked (the schedule's hot loop: a million segments at scale)."""
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + nbytes + self.scale_room > self.bucket_bytes and self.src_segs:
            self.close()
            offset = 0
        self.pair = (t.src, t.dst)
        dtype = t.dtype
        self.src_segs.append(new_segment(t.src_piece, t.src_box, offset, dtype, None))
        self.dst_segs.append(new_segment(t.dst_piece, t.dst_box, offset, dtype, None))
        self.used = offset + nbytes

    def close(self) -> None:
        if self.src_segs:
            at = self.used
            for src_index, dst_index, step, scale_box in self.scales:
                quant, at = step.quant, align(at)
                seg = self.src_segs[src_index]
                self.src_segs[src_index] = Segment(seg.piece, seg.box, seg.offset, seg.dtype, SegmentScales(quant, at))
                self.dst_segs[dst_index] = Segment(step.scale_piece, scale_box, at, quant.scale_dtype)
                at += scale_box.numel * dtype_size(quant.scale_dtype)
            self.out.append(Message(*self.pair, at, tuple(self.src_segs), tuple(self.dst_segs)))  # type: ignore[arg-type]
        self.src_segs, self.dst_segs, self.used = [], [], 0
        self.scales, self.scale_room = [], 0


def _narrowed(t: Transfer, expert: int) -> Transfer:
    """Expert ``expert`` (dim 0) of a grouped-expert transfer."""
    return Transfer(t.name, t.src, t.src_piece, _narrow(t.src_box, 0, expert, 1), t.dst, t.dst_piece,
                    _narrow(t.dst_box, 0, expert, 1), t.dtype, t.quantize)


def _sender_step(t: Transfer) -> QuantizeStep | None:
    """``t``'s quantization if it happens on the sender (in the pack step), else None."""
    return t.quantize if t.quantize is not None and t.quantize.site is QuantSite.SENDER else None


def _expert_family(t: Transfer, expert_groups: Collection[str]) -> tuple | None:
    """What sibling grouped-expert transfers of one layer share (None for other tensors).

    A grouped expert tensor is one refit grouped from per-expert tensors (``expert_groups``) or one both
    backends name grouped already: three or more dimensions, experts first (``experts.gate_proj.weight``
    ``[E, I, H]``)."""
    grouped = t.name in expert_groups or t.src_box.ndim >= 3
    if not grouped or t.src_box.ndim < 2 or t.src_box.sizes[0] < 2:
        return None
    step = _sender_step(t)
    if step is not None and step.quant.block[0] != 1:
        return None  # one expert would split a block
    return (t.dtype, t.src_box.sizes, t.dst_box.offsets[0], t.src_box.offsets[0])


_unit_key = attrgetter("name", "dst_piece")


def _units(pair_transfers: Sequence[Transfer], expert_groups: Collection[str]) -> Iterator[tuple[bool, list[Transfer]]]:
    """Transfers of one pair grouped into units (see the module doc), in order: ``(gather, transfers)``,
    ``gather`` when several transfers feed one destination piece; interleaved sibling experts come as
    sub-transfers, one per expert."""
    runs = [list(run) for _, run in groupby(pair_transfers, _unit_key)]
    families = [_expert_family(run[0], expert_groups) if len(run) == 1 else None for run in runs]
    if not any(families):  # no sibling experts to interleave: every run is a unit
        for run in runs:
            yield len(run) > 1, run
        return
    i = 0
    while i < len(runs):
        family = families[i]
        j = i + 1
        while family is not None and j < len(runs) and families[j] == family and runs[j][0].name != runs[i][0].name:
            j += 1
        if j - i > 1:  # interleave siblings expert by expert: gate_0, up_0, gate_1, up_1, ...
            siblings = [run[0] for run in runs[i:j]]
            yield False, [_narrowed(t, e) for e in range(siblings[0].src_box.sizes[0]) for t in siblings]
        else:
            yield len(runs[i]) > 1, runs[i]
        i = j


def _message_bytes(pair_transfers: Sequence[Transfer], bucket_bytes: int) -> int:
    """The largest message of a pair: a quarter of the bucket where its sender quantizes
    (:data:`QUANTIZED_MESSAGE_SHARE`), though never under two of its largest quantization blocks (one cut holds
    a block's values and its scales in half of it); the bucket elsewhere."""
    blocks = [math.prod(step.quant.block) for t in pair_transfers if (step := _sender_step(t)) is not None]
    if not blocks:
        return bucket_bytes
    return min(bucket_bytes, max(bucket_bytes // QUANTIZED_MESSAGE_SHARE, 2 * max(blocks)) // ALIGN * ALIGN)


def pair_messages(pair_transfers: Sequence[Transfer], bucket_bytes: int, formation: MessageOptions,
                  expert_groups: Collection[str]) -> list[Message]:
    """The messages of one pair's transfers (in plan order), cut as the module doc says."""
    messages: list[Message] = []
    kind = None
    runs_mode, direct_min = formation.mode == MessageMode.RUNS, formation.direct_min_bytes
    plain = not runs_mode and all(t.quantize is None for t in pair_transfers)
    if not runs_mode and not plain:  # a plain pair has no sender step: its messages keep the bucket
        bucket_bytes = _message_bytes(pair_transfers, bucket_bytes)
    shared = _MessageBuilder(bucket_bytes if runs_mode else min(bucket_bytes, formation.shared_max_bytes), messages)
    for gather, parts in _units(pair_transfers, expert_groups):
        if plain and len(parts) == 1:  # the common case, kept short: one small plain transfer
            t = parts[0]
            nbytes = math.prod(t.src_box.sizes) * t.dtype.itemsize
            if nbytes < direct_min and nbytes <= bucket_bytes:
                shared.add_plain(t, nbytes)
                continue
        sizes = [math.prod(t.src_box.sizes) * t.dtype.itemsize for t in parts]
        if runs_mode:
            if gather != kind:  # a new run: close the last one's message
                shared.close()
                kind = gather
            builder = shared
        else:
            builder = _MessageBuilder(bucket_bytes, messages) if sum(sizes) >= direct_min else shared
        for t, nbytes in zip(parts, sizes):
            if nbytes <= bucket_bytes and t.quantize is None:  # what _split_transfer would yield whole
                builder.add_plain(t, nbytes)
            else:
                for src_box, dst_box in _split_transfer(t, bucket_bytes):
                    builder.add(t, src_box, dst_box, src_box.numel * t.dtype.itemsize)
        if builder is not shared:
            builder.close()
    shared.close()
    return messages
