"""What both directions of the executor share: settings, step counting, binding rounds to local memory, deadlines."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass

import torch

from refit_core.contract.errors import TransferError
from refit_core.contract.failures import UpdateMode
from refit_core.net.transport import Fence, Transport
from refit_core.plan.items import Message, Segment, align
from refit_core.run.copies import StagingCopies
from refit_core.run.copy_merging import Strided
from refit_core.run.executor.headers import HeaderScope, PostedHeaders, StepHeaders
from refit_core.run.executor.rounds import (
    Post,
    RoundPlan,
    StagingBuffers,
    direct_span,
    pieces_of,
    region_of,
    staged,
    staged_layout,
)
from refit_core.run.lanes import Lane, lane_for
from refit_core.run.timing import Mark, Phase, StepTimeline, Timeline


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
class ExecutorSettings:
    """How an executor runs its rounds, from the refit's agreed settings and its plan.

    ``bucket_bytes`` bounds a round's staging buffer and ``num_buffers`` how many are in flight;
    ``zero_copy`` False stages every message (for comparisons); ``fingerprint`` is the plan's (checked in
    every step's header); ``timeout_s`` the step's deadline, counted from its start.
    """

    bucket_bytes: int
    num_buffers: int
    zero_copy: bool
    fingerprint: str
    timeout_s: float
    mode: UpdateMode = UpdateMode.IN_PLACE


@dataclass
class StepCount:
    """Steps run so far on one rank's pairs: shared by the executors that take turns on them (the whole
    schedule's and each subset's), so each step's header names the same step on both ends."""

    done: int = 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RoundRunner:
    """State shared by both directions: rounds, peers, buffers, header checks.

    Everything an executor runs with comes through its constructor (``scope``: what its headers claim;
    ``steps``: the step count it shares with the rank's other executors, default its own) or through
    ``run()``; nothing is set from outside.
    """

    gaps_allowed = False
    packs = False
    """Whether this side copies local views into staging buffers (the sender) or out of them."""

    def __init__(self, rounds: list[list[Message]], transport: Transport, peer_offset: int,
                 settings: ExecutorSettings, *, scope: HeaderScope = HeaderScope(),
                 steps: StepCount | None = None) -> None:
        self.rounds = rounds
        self.mode = settings.mode
        self.transport = transport
        self.device = transport.device
        self.peer_offset = peer_offset
        self.bucket_bytes = settings.bucket_bytes
        self.num_buffers = max(1, settings.num_buffers)
        # staged mode: nothing lands in a gen rank's weights before the commit; a sender still sends from them
        self.zero_copy = settings.zero_copy and (self.packs or settings.mode is UpdateMode.IN_PLACE)
        self.timeout_s = settings.timeout_s
        self.steps = StepCount() if steps is None else steps
        self.payload_bytes = sum(m.nbytes for msgs in rounds for m in msgs)
        self.lane: Lane = lane_for(self.device, "refit copies")
        self.plans: list[RoundPlan] = []
        self.buffer_bytes = 0
        self.direct_bytes = 0
        self._peers: list[int] | None = None
        self.headers = StepHeaders(settings.fingerprint, self.device, peer_offset, scope, self.peers())
        self._timeline: Timeline | None = None
        """The recorder of the step in progress (None: not recording)."""
        self.last_timeline: StepTimeline | None = None
        """The last recorded step's spans (None: none recorded yet)."""

    @property
    def step(self) -> int:
        """The step this executor runs next (counted since setup)."""
        return self.steps.done

    def _begin(self, timeline: Timeline | None) -> None:
        """A step starts: begin recording it on ``timeline`` (None: not recorded)."""
        self._timeline = timeline
        if timeline is not None:
            timeline.begin()
            self.transport.timeline = timeline if self.transport.records_spans else None

    def _end(self) -> None:
        """A step ends: keep its spans, if recorded, as :attr:`last_timeline`."""
        timeline, self._timeline = self._timeline, None
        if timeline is not None:
            self.transport.timeline = None
            self.last_timeline = timeline.finish()

    def _mark(self, phase: Phase, index: int) -> Mark | None:
        return Mark(self._timeline, phase, index) if self._timeline is not None else None

    def _exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                  after: Sequence[Fence], index: int, phase: Phase = Phase.TRANSFER) -> Fence:
        """The transport's exchange of round ``index`` (-1: the header), recorded as ``phase`` when asked to."""
        timeline = self._timeline
        control = index < 0
        if timeline is None:
            return self.transport.exchange(sends, recvs, after=after, control=control)
        timeline.round, timeline.phase = index, phase
        posted = time.perf_counter()
        fence = self.transport.exchange(sends, recvs, after=after, control=control)
        if self.transport.records_spans:
            return fence
        return timeline.observe(fence, "transfer", Phase.HEADER if index < 0 else phase, index, posted)

    def _exchange_header(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                         after: Sequence[Fence]) -> Fence:
        return self._exchange(sends, recvs, after, -1)

    def _post_headers(self, version: int, pending: str, peers: Sequence[int] | None = None
                      ) -> tuple[PostedHeaders | None, Fence]:
        """This step's header exchange (:meth:`StepHeaders.post`)."""
        return self.headers.post(self._exchange_header, version, self.step, pending, peers)

    def _check_headers(self, posted: PostedHeaders | None, version: int, deadline: float) -> int:
        """Wait for the peers' headers within the step's deadline and check them (:meth:`StepHeaders.check`)."""
        return self.headers.check(posted, version, self.step, lambda: self._remaining(deadline))

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
        """Resolve every segment to its local view (never a copy) and pick direct messages; then let the
        transport register the memory it will move (:meth:`Transport.register`).

        With ``zero_copy`` False every message is staged (for comparisons).
        """
        with gc_paused():  # a bind makes a few objects per segment: no collector passes over the whole heap
            self._resolve(views)

    def _resolve(self, views: list[torch.Tensor]) -> None:
        pieces = [Strided.of(view) for view in views]
        plans = []
        for msgs in self.rounds:
            plan = RoundPlan()
            for m in msgs:
                parts = m.parts
                for start, end, segs in pieces_of(m, parts, self._segments(m)):
                    self._bind_part(plan, self._peer(m) + self.peer_offset,
                                    [(a - start, b - start) for a, b in parts if start <= a < end], segs, views,
                                    pieces)
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
        self.transport.register([post.direct for p in plans for post in p.posts if post.direct is not None])

    def _bind_part(self, plan: RoundPlan, peer: int, parts: list[tuple[int, int]], segs: Sequence[Segment],
                   views: list[torch.Tensor], pieces: list[Strided]) -> None:
        """A stretch of a message that this side lands or sends alone (``segs`` and its wire ``parts``
        relative to its start), for global rank ``peer``: direct, else staged, posted part by part.
        ``pieces`` are the layouts of ``views``: a segment's view is made only when it is staged."""
        local = [pieces[seg.piece].boxed(seg.box.offsets, seg.box.sizes) for seg in segs]
        nbytes = parts[-1][1]
        begin = (direct_span(local, segs, nbytes, gaps_allowed=self.gaps_allowed)
                 if self.zero_copy and all(self._as_is(seg.piece) for seg in segs) else None)
        region = None if begin is None else region_of(views[segs[0].piece], begin, nbytes)
        if region is not None:
            plan.posts += [Post(peer, b - a, direct=region[a:b]) for a, b in parts]
            plan.direct_pieces.update(seg.piece for seg in segs)
            return
        base = plan.staged_bytes
        plan.posts += [Post(peer, b - a, staging_offset=base + a) for a, b in parts]
        plan.staged_bytes = align(base + nbytes)
        plan.segments.extend(staged(seg, base) for seg in segs)
        plan.views.extend(layout.on(views[seg.piece], pieces[seg.piece]) for layout, seg in zip(local, segs))
        plan.local.extend(local)
        plan.planned.extend(segs)
        plan.staged_pieces.update(seg.piece for seg in segs)

    def _plan_copies(self, template: torch.Tensor) -> None:
        """Each staged round's plain copies, coalesced and grouped once (``template``: any buffer), from
        their layouts: only the merged copies' views are made."""
        buffer = Strided.of(template)
        for plan in self.plans:
            plain = [i for i, (seg, planned) in enumerate(zip(plan.segments, plan.planned))
                     if seg.quant is None and self._as_is(planned.piece)]
            if plain:
                plan.copies = StagingCopies.of_layouts([plan.local[i] for i in plain], [plan.views[i] for i in plain],
                                                       [staged_layout(plan.segments[i], buffer) for i in plain],
                                                       template, into_buffer=self.packs)

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

    def _buffers(self) -> StagingBuffers:
        staged_rounds = sum(1 for p in self.plans if p.staged_bytes)
        return StagingBuffers(self.lane, self.buffer_bytes, self.device, min(self.num_buffers, staged_rounds))

    def _finish(self, fences: list[Fence], deadline: float) -> None:
        for fence in fences:
            fence.synchronize(self._remaining(deadline))

    def _stats(self, version: int, start: float, buffers: Sized) -> StepStats:
        self.steps.done += 1
        return StepStats(version, self.payload_bytes, time.perf_counter() - start,
                         len(buffers) * self.buffer_bytes, self.direct_bytes)


__all__ = ["ExecutorSettings", "RoundRunner", "StepCount", "StepStats"]
