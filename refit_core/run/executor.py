"""The executor: runs this rank's part of the schedule every step.

Per round, the sender packs the segments of its *staged* messages (casting to the wire dtype) into a
contiguous staging buffer with one batched copy, then posts the round's sends as one grouped
exchange; the receiver posts its receives, then unpacks its staged messages with one batched copy.
A message whose segments are one contiguous, gap-free run of this side's memory in the same dtype
(a whole parameter, the ``[Q; K; V]`` rows of a fused QKV, ``[gate_e; up_e]`` of stacked experts) is
*direct*: sent straight from the weights or received straight into them, with no staging copy. Each
side decides that for itself at ``bind()``: the bytes on the wire are the same either way.

With ``num_buffers`` staging buffers the packing of round k+1 overlaps the transfer of round k and
the unpacking of round k-1 on CUDA (copies on a side stream, the transport on its own stream,
ordered by events only; a buffer is reused only after the event of its last use). Staging memory
never exceeds ``num_buffers x bucket_bytes``; each buffer is allocated when a step's staged rounds first
need it (not before the first byte moves) and released at the step's end. Refit's streams first wait for
the work already queued on the caller's current stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from refit_core.contract.errors import TransferError
from refit_core.contract.failures import UpdateMode
from refit_core.contract.lora import LoraFactors, LoraMerge
from refit_core.contract.spec import Quantization, contiguous_strides, dtype_size
from refit_core.net.transport import Fence, Transport
from refit_core.plan.items import Message, Segment, align
from refit_core.plan.subset import WHOLE
from refit_core.run.copies import StagingCopies
from refit_core.run.lanes import Lane, current_work, lane_for
from refit_core.run.merge import BoxToMerge, Deltas, MergeBatch
from refit_core.run.quant.batched import quantize_batch
from refit_core.run.quant.boxes import BoxToQuantize, QuantBatch
from refit_core.run.quant.fast import Quantizer, default_quantizer
from refit_core.run.timing import Mark, Phase, StepTimeline, Timeline

MAGIC = 0x52454649  # "REFI"
HEADER_WORDS = 6


class SubsetMismatchError(TransferError):
    """The two ends of a pair run different subsets in one step (:mod:`refit_core.plan.subset`): found in
    the step's headers, before any byte of the step moves."""


def subset_text(digest: int, size: int) -> str:
    """How an error names a step's subset (``digest`` :data:`~refit_core.plan.subset.WHOLE`: the whole plan)."""
    return "the whole plan" if digest == WHOLE else f"a subset of {size} tensor(s) (digest {digest:x})"


@dataclass
class StepStats:
    """What one step moved and how long it took on this rank."""

    version: int
    bytes: int
    seconds: float
    staging_bytes: int
    direct_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


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


def _buffer_views(buffer: torch.Tensor, segments: Sequence[StagedSegment]) -> list[torch.Tensor]:
    """Typed, shaped views of ``buffer`` for staged segments."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for seg in segments:
        flat = typed.get(seg.dtype)
        if flat is None:
            flat = typed[seg.dtype] = buffer.view(seg.dtype)
        views.append(flat.as_strided(seg.sizes, seg.strides, seg.offset // dtype_size(seg.dtype)))
    return views


def _pack(buffer: torch.Tensor, plan: RoundPlan, deltas: Deltas | None = None) -> None:
    """Copy (casting) every plain source into its segment of ``buffer``; quantize the quantized ones;
    merge the LoRA-adapted ones (merged mode, with the step's ``deltas``)."""
    if plan.copies is not None:
        plan.copies.run(buffer)
    if plan.quantization is not None:
        plan.quantization.run(buffer)
    if plan.merges is not None:
        plan.merges.run(buffer, deltas)


def direct_region(views: Sequence[torch.Tensor], segments: Sequence[Segment], nbytes: int, *,
                  gaps_allowed: bool) -> torch.Tensor | None:
    """A flat uint8 tensor over local memory whose bytes are exactly the message, or None.

    That is so when every segment's view is contiguous, of the wire dtype, in one storage, and sits
    at the same distance from the first as in the message. A receiver must not write the alignment
    gaps between segments (they may be other weights), so it also needs a gap-free message; a sender
    merely reads gap bytes, so it may allow them.
    """
    if not views:
        return None
    first = views[0]
    storage = first.untyped_storage()
    start = first.data_ptr() - segments[0].offset
    expected = 0
    for view, seg in zip(views, segments):
        if view.dtype != seg.dtype or not view.is_contiguous() or view.device != first.device:
            return None
        if view.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if view.data_ptr() - start != seg.offset or (not gaps_allowed and seg.offset != expected):
            return None
        expected = seg.offset + seg.nbytes
    if expected != nbytes:
        return None
    begin = start - storage.data_ptr()
    if begin < 0 or begin + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, begin, (nbytes,), (1,))


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


class _RoundRunner:
    """State shared by both directions: rounds, peers, buffers, header checks."""

    gaps_allowed = False
    packs = False
    """Whether this side copies local views into staging buffers (the sender) or out of them."""

    def __init__(self, rounds: list[list[Message]], transport: Transport, peer_offset: int, *,
                 bucket_bytes: int, num_buffers: int, zero_copy: bool, fingerprint: str,
                 timeout_s: float, mode: UpdateMode = UpdateMode.IN_PLACE) -> None:
        self.rounds = rounds
        self.mode = mode
        self.transport = transport
        self.device = transport.device
        self.peer_offset = peer_offset
        self.bucket_bytes = bucket_bytes
        self.num_buffers = max(1, num_buffers)
        # staged mode: nothing lands in a gen rank's weights before the commit; a sender still sends from them
        self.zero_copy = zero_copy and (self.packs or mode is UpdateMode.IN_PLACE)
        self.timeout_s = timeout_s
        self.fingerprint = int(fingerprint[:15], 16)
        self.payload_bytes = sum(m.nbytes for msgs in rounds for m in msgs)
        self.lane: Lane = lane_for(self.device, "refit copies")
        self.plans: list[RoundPlan] = []
        self.buffer_bytes = 0
        self.direct_bytes = 0
        self.step = 0
        self.timeline: Timeline | None = None
        """Set to record the next steps' spans (``refit bench --timeline``); see :mod:`refit_core.run.timing`."""
        self.last_timeline: StepTimeline | None = None
        """The last recorded step's spans."""
        self.subset = (WHOLE, 0)
        """(digest, size) of the subset these rounds move, checked against every peer's in the headers."""
        self.explain: Callable[[tuple[int, int], tuple[int, int]], str] | None = None
        """Names what differs between a peer's subset and this rank's (theirs, ours), for the error."""
        self.header_peers: list[int] | None = None
        """The peers the headers go to (None: this executor's own): a sub-schedule's executor talks to
        every peer of the whole schedule, so that two ends running different subsets both find out."""
        self._headers: dict[int, _HeaderMemory] = {}
        """The header exchange's memory, by number of peers (each step reuses it)."""
        self._peers: list[int] | None = None
        peers = self.peers()
        if peers:  # at setup, not inside the first step (a gen rank binds at its first step)
            self._header_memory(len(peers))

    def _begin(self) -> None:
        """A step starts: begin recording it if asked to."""
        if self.timeline is not None:
            self.timeline.begin()
            self.transport.timeline = self.timeline if self.transport.records_spans else None

    def _end(self) -> None:
        if self.timeline is not None:
            self.transport.timeline = None
            self.last_timeline = self.timeline.finish()

    def _mark(self, phase: Phase, index: int) -> Mark | None:
        return Mark(self.timeline, phase, index) if self.timeline is not None else None

    def _exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                  after: Sequence[Fence], index: int) -> Fence:
        """The transport's exchange of round ``index`` (-1: the header), recorded when asked to."""
        timeline = self.timeline
        control = index < 0
        if timeline is None:
            return self.transport.exchange(sends, recvs, after=after, control=control)
        timeline.round = index
        posted = time.perf_counter()
        fence = self.transport.exchange(sends, recvs, after=after, control=control)
        if self.transport.records_spans:
            return fence
        return timeline.observe(fence, "transfer", Phase.HEADER if index < 0 else Phase.TRANSFER, index, posted)

    def peers(self) -> list[int]:
        """This side's peers in the rounds (their ranks within the other side), sorted."""
        if self._peers is None:
            self._peers = sorted({self._peer(m) for msgs in self.rounds for m in msgs})
        return self._peers

    def _peer(self, m: Message) -> int:
        raise NotImplementedError

    def _segments(self, m: Message) -> tuple[Segment, ...]:
        raise NotImplementedError

    def bind(self, views: list[torch.Tensor]) -> None:
        """Resolve every segment to its local view (never a copy) and pick direct messages.

        With ``zero_copy`` False every message is staged (for comparisons).
        """
        plans = []
        for msgs in self.rounds:
            plan = RoundPlan()
            for m in msgs:
                parts = m.parts
                for start, end, segs in _pieces_of(m, parts, self._segments(m)):
                    self._bind_part(plan, self._peer(m) + self.peer_offset,
                                    [(a - start, b - start) for a, b in parts if start <= a < end], segs, views)
            plans.append(plan)
        buffer_bytes = max((p.staged_bytes for p in plans), default=0)
        if buffer_bytes > self.bucket_bytes:
            raise TransferError(f"refit bug: a round needs {buffer_bytes} staging bytes "
                                f"but the bucket is {self.bucket_bytes}")
        self.plans = plans
        self.buffer_bytes = buffer_bytes
        self.direct_bytes = sum(post.nbytes for p in plans for post in p.posts if post.direct is not None)
        if buffer_bytes and (self.packs or self.mode is UpdateMode.IN_PLACE):  # a staged receiver copies at commit
            self._plan_copies(self.lane.allocate(buffer_bytes, self.device))

    def _bind_part(self, plan: RoundPlan, peer: int, parts: list[tuple[int, int]], segs: Sequence[Segment],
                   views: list[torch.Tensor]) -> None:
        """A stretch of a message that this side lands or sends alone (``segs`` and its wire ``parts``
        relative to its start), for global rank ``peer``: direct, else staged, posted part by part."""
        seg_views = [seg.box.slice_of(views[seg.piece]) for seg in segs]
        nbytes = parts[-1][1]
        region = (direct_region(seg_views, segs, nbytes, gaps_allowed=self.gaps_allowed)
                  if self.zero_copy and all(self._as_is(seg.piece) for seg in segs) else None)
        if region is not None:
            plan.posts += [Post(peer, b - a, direct=region[a:b]) for a, b in parts]
            plan.direct_pieces.update(seg.piece for seg in segs)
            return
        base = plan.staged_bytes
        plan.posts += [Post(peer, b - a, staging_offset=base + a) for a, b in parts]
        plan.staged_bytes = align(base + nbytes)
        plan.segments.extend(_staged(seg, base) for seg in segs)
        plan.views.extend(seg_views)
        plan.planned.extend(segs)
        plan.staged_pieces.update(seg.piece for seg in segs)

    def _plan_copies(self, template: torch.Tensor) -> None:
        """Each staged round's plain copies, coalesced and grouped once (``template``: any buffer)."""
        for plan in self.plans:
            plain = [(view, staged) for view, staged, seg, planned in
                     zip(plan.views, _buffer_views(template, plan.segments), plan.segments, plan.planned)
                     if seg.quant is None and self._as_is(planned.piece)]
            if plain:
                plan.copies = StagingCopies([v for v, _ in plain], [s for _, s in plain],
                                            into_buffer=self.packs)

    def _as_is(self, piece: int) -> bool:
        """Whether piece ``piece``'s bytes are its view's as they are (False: the pack step computes them)."""
        return True

    def _settle(self, fence: Fence | None, deadline: float) -> None:
        """On the host path, wait for ``fence`` within the step's deadline (CUDA orders by events)."""
        if fence is not None and self.device.type != "cuda":
            fence.synchronize(self._remaining(deadline))

    def _remaining(self, deadline: float) -> float:
        """Seconds left of this step; the step deadline counts from its start, not from the last send."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"refit step {self.step} did not complete within its deadline of "
                                f"{self.timeout_s:.0f} s (a peer is stopped or hung)")
        return left

    def _post_headers(self, version: int, pending: str, peers: Sequence[int] | None = None
                      ) -> tuple[_Headers | None, Fence]:
        """Send ``[magic, fingerprint, version, step, subset digest, subset size]`` to each peer (default:
        :attr:`header_peers`, else this side's peers) and post the receives of theirs (None without peers);
        the step's other host work runs while they travel. Also returns the fence every operation of the
        step waits for: the caller's ``pending`` work on its current stream, then the header's copy."""
        if peers is None:
            peers = self._header_peers()
        if not peers:
            return None, current_work(self.device, pending)
        memory = self._header_memory(len(peers))
        words = self._header_words(version, self.step)
        if memory.written != words:  # else written while the last step's bytes moved
            self._write_header(memory, words)
        ready = current_work(self.device, pending)  # queued after a copy written now: one event covers both
        after = [ready] if memory.copied is None else [ready, memory.copied]
        offset, mine = self.peer_offset, memory.mine
        fence = self._exchange([(p + offset, mine) for p in peers],
                               [(p + offset, row) for p, row in zip(peers, memory.their_rows)], after, -1)
        return _Headers(fence, list(peers), memory), ready

    def _header_peers(self) -> list[int]:
        """The peers this executor's headers go to: :attr:`header_peers`, else its own."""
        return self.peers() if self.header_peers is None else self.header_peers

    def _header_words(self, version: int, step: int) -> tuple[int, ...]:
        """This rank's header for ``step``: ``[magic, fingerprint, version, step, subset digest, subset size]``."""
        return (MAGIC, self.fingerprint, version, step, *self.subset)

    def _write_header(self, memory: _HeaderMemory, words: tuple[int, ...]) -> None:
        """Write ``words`` into ``memory.mine`` (on CUDA through pinned memory, on the current stream: the
        header exchange that last read them has completed)."""
        if memory.staged is not None:
            memory.staged_words[:] = words
            memory.mine.copy_(memory.staged, non_blocking=True)
        else:
            memory.mine.copy_(torch.tensor(words, dtype=torch.int64))
        memory.written = words
        memory.copied = None

    def _prepare_next_header(self, version: int) -> None:
        """While this step's bytes move, write the next step's header as it most likely reads (version
        ``version + 1`` from a sender, the same subset), so that the next step sends it without a copy
        first; a next step that differs writes its own (:meth:`_post_headers`)."""
        memory = self._headers.get(len(self._header_peers()))
        if memory is None:
            return
        self._write_header(memory, self._header_words(version + 1 if version >= 0 else version, self.step + 1))
        if memory.staged is not None:  # the next step's exchange may wait on another current stream
            memory.copied = current_work(self.device, "the next header's copy")

    def _header_memory(self, peers: int) -> _HeaderMemory:
        """The header exchange's memory for ``peers`` peers, made once (for this executor's own peers when
        it is made, for others at the first step that names them)."""
        memory = self._headers.get(peers)
        if memory is None:
            memory = self._headers[peers] = _HeaderMemory.make(peers, self.device)
        return memory

    def _check_headers(self, posted: _Headers | None, version: int, deadline: float) -> int:
        """Wait for the peers' headers and check them (same plan, step and subset; one version)."""
        if posted is None:
            return version
        posted.fence.synchronize(self._remaining(deadline))
        theirs = dict(zip(posted.peers, posted.memory.theirs.tolist()))
        versions = set()
        for peer, header in theirs.items():
            magic, fp, peer_version, step, *subset = header
            if magic != MAGIC or fp != self.fingerprint or step != self.step:
                raise TransferError(
                    f"peer rank {peer + self.peer_offset} runs a different refit plan or step "
                    f"(fingerprint {fp:x} step {step} vs ours {self.fingerprint:x} step {self.step}); "
                    "both sides must call setup() with the same models and options")
            if tuple(subset) != self.subset:
                explained = "" if self.explain is None else f" ({self.explain((subset[0], subset[1]), self.subset)})"
                raise SubsetMismatchError(
                    f"peer rank {peer + self.peer_offset} moves {subset_text(*subset)} in this step, this rank "
                    f"{subset_text(*self.subset)}{explained}: both sides must name the same tensors "
                    "(send(only=...) on every train rank, receive(only=...) on every gen rank); nothing of the "
                    "step moved")
            versions.add(peer_version)
        if len(versions) > 1:
            raise TransferError(f"train ranks sent different weight versions {sorted(versions)} in one step: "
                                "every train rank must call send() with the same version")
        return versions.pop()

    def _buffers(self) -> _StagingBuffers:
        staged_rounds = sum(1 for p in self.plans if p.staged_bytes)
        return _StagingBuffers(self.lane, self.buffer_bytes, self.device, min(self.num_buffers, staged_rounds))

    def _finish(self, fences: list[Fence], deadline: float) -> None:
        for fence in fences:
            fence.synchronize(self._remaining(deadline))

    def _stats(self, version: int, start: float, buffers: Sized) -> StepStats:
        self.step += 1
        return StepStats(version, self.payload_bytes, time.perf_counter() - start,
                         len(buffers) * self.buffer_bytes, self.direct_bytes)


class _StagingBuffers:
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


@dataclass
class _HeaderMemory:
    """Where a step's header exchange lives, kept from step to step: one tensor on the device, this rank's
    header in its first row (``mine``) and the peers' in the rows after it (``theirs``, one each in
    ``their_rows``: views made once, not in every step). On CUDA this rank's words are written into
    ``staged`` (pinned host memory) through its numpy view ``staged_words``, then copied to ``mine``."""

    mine: torch.Tensor
    theirs: torch.Tensor
    their_rows: tuple[torch.Tensor, ...]
    staged: torch.Tensor | None
    staged_words: Any
    written: tuple[int, ...] | None = None
    """The words row 0 holds (None: none yet)."""
    copied: Fence | None = None
    """Completion of the copy that wrote them, when it was queued during the step before (else None)."""

    @classmethod
    def make(cls, peers: int, device: torch.device) -> _HeaderMemory:
        rows = torch.empty((1 + peers, HEADER_WORDS), dtype=torch.int64, device=device)
        staged = torch.empty(HEADER_WORDS, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
        theirs = rows[1:]
        return cls(rows[0], theirs, tuple(theirs.unbind()), staged, None if staged is None else staged.numpy())


@dataclass(frozen=True)
class _Headers:
    """One step's header exchange in flight: its fence, the peers, and the memory it lives in (kept until
    the fence completes)."""

    fence: Fence
    peers: list[int]
    memory: _HeaderMemory


def _pieces_of(m: Message, parts: tuple[tuple[int, int], ...],
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


def _staged(seg: Segment, base: int) -> StagedSegment:
    sizes = seg.box.sizes
    if seg.scales is None:
        return StagedSegment(seg.dtype, sizes, contiguous_strides(sizes), base + seg.offset)
    return StagedSegment(seg.dtype, sizes, contiguous_strides(sizes), base + seg.offset, seg.scales.quant,
                         base + seg.scales.offset)


class SendExecutor(_RoundRunner):
    """Runs a train rank's rounds: pack (staged messages only; quantizing where the plan says), send."""

    gaps_allowed = True
    packs = True
    quantizer: Quantizer = default_quantizer()
    merges: Sequence[LoraMerge | None] = ()
    """Per bound piece, the LoRA adapter merged into it in the pack step (merged mode; set before
    :meth:`bind`); empty or None: sent as it is."""
    origins: Sequence[tuple[int, ...]] = ()
    """Per bound piece, its box's offsets in its whole tensor (where merged boxes sit in the base weight)."""
    factors: Mapping[str, LoraFactors] | None = None
    """The adapters gathered for the current step (merged mode: set before every :meth:`run`)."""
    deltas: Deltas | None = None
    """The merged boxes' deltas, per step (None: nothing merged)."""

    def _peer(self, m: Message) -> int:
        return m.dst

    def _segments(self, m: Message) -> tuple[Segment, ...]:
        return m.src_segments

    def _merge_of(self, piece: int) -> LoraMerge | None:
        return self.merges[piece] if piece < len(self.merges) else None

    def _as_is(self, piece: int) -> bool:
        return self._merge_of(piece) is None

    def bind(self, views: list[torch.Tensor]) -> None:
        super().bind(views)
        for plan in self.plans:
            plan.quantization = quantize_batch(
                [BoxToQuantize(view, seg.quant, seg.offset, seg.scales_offset)
                 for seg, view, planned in zip(plan.segments, plan.views, plan.planned)
                 if seg.quant is not None and self._as_is(planned.piece)], self.quantizer)
            plan.merges = self._merge_batch(plan, self.origins)
        merged = [box for plan in self.plans if plan.merges is not None for box in plan.merges.boxes]
        self.deltas = Deltas(merged) if merged else None
        self._warm_up_quantizer()

    def _merge_batch(self, plan: RoundPlan, origins: Sequence[tuple[int, ...]]) -> MergeBatch | None:
        """The round's merged segments (each a box of a base weight; its rows and columns in the whole weight)."""
        merged = []
        for staged, view, seg in zip(plan.segments, plan.views, plan.planned):
            piece = seg.piece
            merge = self._merge_of(piece)
            if merge is None:
                continue
            if staged.quant is not None:
                raise TransferError(f"{merge.module}: merged LoRA cannot be quantized in the same pack step "
                                    "(send merged weights unquantized, or adapters in adapter mode)")
            if len(seg.box.sizes) != 2 or piece >= len(origins):
                raise TransferError(f"refit bug: merged piece {piece} ({merge.module}) is not a bound 2-D box")
            row, col = (o + s for o, s in zip(origins[piece], seg.box.offsets))
            rows, cols = seg.box.sizes
            merged.append(BoxToMerge(view, merge, slice(row, row + rows), slice(col, col + cols), staged.dtype,
                                     staged.sizes, staged.strides, staged.offset))
        return MergeBatch(merged) if merged else None

    def _warm_up_quantizer(self) -> None:
        """Compile the quantizer's kernels at setup, not inside the first step (where peers would wait)."""
        warmed: set[object] = set()
        for plan in self.plans:
            if plan.quantization is not None:
                plan.quantization.warm_up(warmed)

    def run(self, version: int) -> StepStats:
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        self._begin()
        headers, ready = self._post_headers(version, "the trainer's pending work")
        buffers = self._buffers()
        self._check_headers(headers, version, deadline)
        if self.deltas is not None:
            self.deltas.begin(self.factors)
        free: list[Fence | None] = [None] * len(buffers)
        pending: list[Fence] = []
        staged = 0
        for index, plan in enumerate(self.plans):
            after: list[Fence] = []
            buffer = None
            if plan.staged_bytes:
                slot = staged % len(buffers)
                staged += 1
                buffer = buffers[slot]
                self._settle(free[slot], deadline)
                after.append(self.lane.run(partial(_pack, buffer, plan, self.deltas),
                                           after=[ready, free[slot]], mark=self._mark(Phase.PACK, index)))
            fence = self._exchange(plan.pairs(buffer), [], after or [ready], index)
            pending.append(fence)
            if plan.staged_bytes:
                free[slot] = fence
        self._prepare_next_header(version)
        self._finish(pending, deadline)
        if self.deltas is not None:
            self.deltas.end()
        self._end()
        stats = self._stats(version, start, buffers)
        del buffers, free, pending
        return stats


class ReceiveExecutor(_RoundRunner):
    """Runs a gen rank's rounds: receive (straight into the weights where possible), unpack the rest."""

    def _peer(self, m: Message) -> int:
        return m.src

    def _segments(self, m: Message) -> tuple[Segment, ...]:
        return m.dst_segments

    touched: set[int]
    _landed: tuple[torch.Tensor, list[int]] | None = None
    _commit_copies: StagingCopies | None = None
    """Staged mode: every round's copies from the step-wide buffer into the destinations, planned at the
    first commit (the buffer's layout is the same every step, its address need not be)."""

    def run(self, version_hint: int = -1) -> StepStats:
        """Receive one step. In place: straight into the destinations (``touched`` names the pieces
        that may have been written, also when this raises). Staged: into a step-wide staging
        buffer only; :meth:`commit` then writes the destinations, or :meth:`discard` drops it."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        self.touched = set()
        self._landed = None
        self._begin()
        headers, ready = self._post_headers(version_hint, "the engine's pending work")
        if self.mode is UpdateMode.STAGED:
            return self._run_staged(self._check_headers(headers, version_hint, deadline), version_hint, start,
                                    deadline, ready)
        buffers = self._buffers()
        version = self._check_headers(headers, version_hint, deadline)
        free: list[Fence | None] = [None] * len(buffers)
        pending: list[Fence] = []
        staged = 0
        for index, plan in enumerate(self.plans):
            self.touched |= plan.direct_pieces
            if not plan.staged_bytes:  # straight into the weights: after the engine's pending work
                pending.append(self._exchange([], plan.pairs(None), [ready], index))
                continue
            slot = staged % len(buffers)
            staged += 1
            buffer = buffers[slot]
            previous = free[slot]
            self._settle(previous, deadline)
            received = self._exchange([], plan.pairs(buffer), [ready] if previous is None else [ready, previous], index)
            self._settle(received, deadline)
            self.touched |= plan.staged_pieces
            assert plan.copies is not None
            unpacked = self.lane.run(partial(plan.copies.run, buffer), after=[received],
                                     mark=self._mark(Phase.UNPACK, index))
            free[slot] = unpacked
            pending += [received, unpacked]
        self._prepare_next_header(version_hint)
        self._finish(pending, deadline)
        self._end()
        stats = self._stats(version, start, buffers)
        del buffers, free, pending
        return stats

    def _run_staged(self, version: int, version_hint: int, start: float, deadline: float, ready: Fence
                    ) -> StepStats:
        """Every round's messages into one step-wide buffer; the destinations are not touched."""
        offsets, total = [], 0
        for plan in self.plans:
            offsets.append(total)
            total += plan.staged_bytes
        buffer = self.lane.allocate(total, self.device)
        pending = [self._exchange([], plan.pairs(buffer[off:off + plan.staged_bytes]), [ready], index)
                   for index, (plan, off) in enumerate(zip(self.plans, offsets)) if plan.posts]
        self._prepare_next_header(version_hint)
        self._finish(pending, deadline)
        self._end()
        self._landed = (buffer, offsets)
        stats = self._stats(version, start, [])
        stats.staging_bytes = total
        return stats

    def commit(self) -> None:
        """Staged mode: copy the landed step into the destinations (in place: nothing is left to do)."""
        if self._landed is None:
            return
        buffer, offsets = self._landed
        self._landed = None
        if self._commit_copies is None:
            shifted = [dataclasses.replace(seg, offset=seg.offset + off)
                       for plan, off in zip(self.plans, offsets) for seg in plan.segments]
            self._commit_copies = StagingCopies([view for plan in self.plans for view in plan.views],
                                                _buffer_views(buffer, shifted), into_buffer=False)
        for plan in self.plans:
            self.touched |= plan.staged_pieces
        self.lane.run(partial(self._commit_copies.run, buffer)).synchronize(self.timeout_s)

    def discard(self) -> None:
        """Staged mode: drop a landed step without touching the destinations."""
        self._landed = None


class ForwardExecutor:
    """Runs a gen rank's forwarding within its node (:mod:`refit_core.plan.relay`) after its own step landed.

    ``rounds`` are every round of the forwarding plan, each with this rank's messages of both
    directions (empty where it has none). Each round's sends (from this rank's destinations, which
    hold the step) and receives (into them) are posted as one exchange, so that two ranks forwarding
    to each other never wait on each other; rounds run one after another, staged parts packed and
    unpacked synchronously (the forwarded regions are small beside the step).
    """

    def __init__(self, rank: int, rounds: list[list[Message]], transport: Transport, peer_offset: int,
                 **executor_args: Any) -> None:
        self.sends = SendExecutor([[m for m in msgs if m.src == rank] for msgs in rounds], transport, peer_offset,
                                  **executor_args)
        self.receives = ReceiveExecutor([[m for m in msgs if m.dst == rank] for msgs in rounds], transport,
                                        peer_offset, **executor_args)
        self.touched: set[int] = set()
        """The destination pieces the last step's forwarding may have written (also when it raised)."""

    def bind(self, views: list[torch.Tensor]) -> None:
        self.sends.bind(views)
        self.receives.bind(views)

    def run(self, version: int) -> StepStats:
        """Forward one step; both directions' headers are checked first (fingerprint, step, version)."""
        sends, receives = self.sends, self.receives
        start = time.perf_counter()
        deadline = time.monotonic() + receives.timeout_s
        self.touched = set()
        peers = sorted(set(sends.peers()) | set(receives.peers()))
        headers, ready = receives._post_headers(version, "the engine's pending work", peers)
        version = receives._check_headers(headers, version, deadline)
        lane = receives.lane
        send_buffer = lane.allocate(sends.buffer_bytes, receives.device) if sends.buffer_bytes else None
        receive_buffer = lane.allocate(receives.buffer_bytes, receives.device) if receives.buffer_bytes else None
        for index, (out, into) in enumerate(zip(sends.plans, receives.plans)):
            if not out.posts and not into.posts:
                continue
            after = [ready]
            if out.staged_bytes:
                assert send_buffer is not None
                after.append(lane.run(partial(_pack, send_buffer, out), after=[ready]))
            self.touched |= into.direct_pieces
            fence = receives._exchange(out.pairs(send_buffer if out.staged_bytes else None),
                                       into.pairs(receive_buffer if into.staged_bytes else None), after, index)
            fence.synchronize(receives._remaining(deadline))
            if into.staged_bytes:
                assert receive_buffer is not None and into.copies is not None
                self.touched |= into.staged_pieces
                lane.run(partial(into.copies.run, receive_buffer), after=[fence]).synchronize(
                    receives._remaining(deadline))
        sends.step += 1
        stats = receives._stats(version, start, [])
        stats.bytes += sends.payload_bytes
        stats.staging_bytes = sum(b.numel() for b in (send_buffer, receive_buffer) if b is not None)
        return stats
