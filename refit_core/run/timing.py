"""Where setup and step time go on one rank: setup phases, a step's spans per lane, a colocated step's trace.

**Setup** (:class:`SetupTimes`): where one rank's ``setup()`` went: seconds per phase and the metadata it
downloaded. ``refit demo`` and ``refit bench`` print it; ``benchmarks/setup_scaling.py`` measures it against the
world size. Phases, in order: the plugin's pieces (and their view checks), the metadata exchange
through the rendezvous store (publish this rank's; the planner, train rank 0, also downloads every
rank's), planning (the planner plans the whole refit and publishes each rank's part; every other
rank waits for, reads and checks its own part: :mod:`refit_core.plan.rankplan`), agreement (a barrier on
the plan's fingerprint), opening the transport, and binding the schedule to the views (a gen rank
binds at its first step, after the plugin's ``refit_begin_update``). Phases that wait for other
ranks (``metadata`` on the planner: until every rank has published; ``plan`` elsewhere: until the
planner has planned; ``agree``; the transport) include that wait: a rank that starts early shows
the late ones' start-up there.

**Step timeline** (:class:`Timeline`, for ``refit bench --timeline``): where a step's time goes on one rank:
pack / transfer / unpack spans per lane. An executor given a :class:`Timeline` records, for one step, the
header exchange, every round's packing (sender) or unpacking (receiver) on the copy lane, and every round's
transfer. On CUDA the
spans are CUDA events recorded on the stream that runs the work (the copy lane's stream, each NCCL
communicator's stream: one lane per stream), resolved after the step; on CPU they are
``time.perf_counter`` stamps: copies run on the host, and a gloo transfer is drawn from when it was
posted (or the previous round's transfer ended, whichever is later: gloo delivers a pair's messages
in order) to when the host saw it complete. Spans of one lane never overlap; times are seconds from
the step's start, and :attr:`StepTimeline.start` (``perf_counter``, one clock for every process of a
machine) lines up ranks.

**Colocated step trace** (:class:`StepTrace`): where one colocated step's time goes: host timestamps on each
rank, device time of the copies. Off by default (``RefitOptions(step_trace=True)`` turns it on); read back
after a step as ``RefitSender.colocated_trace`` / ``RefitReceiver.colocated_trace``. Host marks are
``time.perf_counter()`` values, which on Linux read ``CLOCK_MONOTONIC``: the marks of two processes of
one host are on one clock, so the time from the trainer's *ready* to the engine seeing it is a plain
difference (:func:`breakdown`).

Marks, train rank: ``start`` (``send`` entered), ``checked`` (the moved-parameter check done),
``posted`` (*ready* written), ``done_seen`` (every peer's *done* read), ``end`` (``send`` returns).
Gen rank: ``start``, ``ready_seen`` (every header read and checked), ``enqueue_begin``,
``enqueued`` (every copy queued), ``gpu_done_seen`` (the copies' completion observed),
``done_posted``. On CUDA the gen rank also records device milliseconds: ``wait`` (from the moment
it began queueing until its stream passed the trainer's and the engine's events), then one entry per
launch group of the copy program (:data:`refit_core.run.copies.CATEGORIES`), and ``copies`` (their sum).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from refit_core.net.transport.base import Fence, Stamp
from refit_core.units import format_bytes

# -- setup ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SetupTimes:
    """One rank's setup, broken down (seconds); ``metadata_bytes`` is what it read from the store
    (the planner: every rank's metadata; another rank: the options, the sizes and its own part of the
    plan); ``planner`` says whether this rank planned (train rank 0)."""

    pieces_s: float
    metadata_s: float
    plan_s: float
    agree_s: float
    transport_s: float
    bind_s: float | None
    metadata_bytes: int
    planner: bool = False

    @property
    def total_s(self) -> float:
        """All phases (the bind included once it happened)."""
        return (self.pieces_s + self.metadata_s + self.plan_s + self.agree_s + self.transport_s
                + (self.bind_s or 0.0))

    def line(self) -> str:
        """``setup 1.23 s: pieces 0.01, metadata 0.40 (12.3 KiB read), plan 0.30, ...``."""
        bind = "at first step" if self.bind_s is None else f"{self.bind_s:.2f}"
        plan = "plan (planner)" if self.planner else "plan (own part)"
        return (f"setup {self.total_s:.2f} s: pieces {self.pieces_s:.2f}, metadata {self.metadata_s:.2f} "
                f"({format_bytes(self.metadata_bytes)} read), {plan} {self.plan_s:.2f}, agree {self.agree_s:.2f}, "
                f"transport {self.transport_s:.2f}, bind {bind}")

    def to_json(self) -> dict[str, float | int | None]:
        return {"pieces_s": self.pieces_s, "metadata_s": self.metadata_s, "plan_s": self.plan_s,
                "agree_s": self.agree_s, "transport_s": self.transport_s, "bind_s": self.bind_s,
                "metadata_bytes": self.metadata_bytes, "planner": self.planner, "total_s": self.total_s}


# -- step timeline (``refit bench --timeline``) ----------------------------------------------------------------------


class SetupClock:
    """Times one setup's phases as they run; :meth:`times` reads them back as :class:`SetupTimes`."""

    PHASES = ("pieces", "metadata", "plan", "agree", "transport")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.bind_s: float | None = None
        """The first bind's (None: not bound yet; a gen rank binds at its first step)."""
        self.metadata_bytes = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (one of :data:`PHASES`; not recorded if it raises)."""
        began = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - began

    def times(self, planner: bool) -> SetupTimes | None:
        """The setup's times (None until every phase but the bind completed)."""
        if any(name not in self.seconds for name in self.PHASES):
            return None
        seconds = self.seconds
        return SetupTimes(seconds["pieces"], seconds["metadata"], seconds["plan"], seconds["agree"],
                          seconds["transport"], self.bind_s, self.metadata_bytes, planner)


class Phase(StrEnum):
    """What a span of a lane was doing."""

    HEADER = "header"
    PACK = "pack"
    TRANSFER = "transfer"
    UNPACK = "unpack"
    FORWARD = "forward"
    """A relaying rank sends a round it received on to the replicas below it."""


@dataclass(frozen=True)
class Span:
    """``phase`` of round ``round`` (-1: the step's header) busy on ``lane`` from ``start`` to ``end``
    (seconds from the step's start)."""

    lane: str
    phase: Phase
    round: int
    start: float
    end: float


@dataclass(frozen=True)
class StepTimeline:
    """One rank's recorded step: its spans, its length, and when it started (``perf_counter``)."""

    start: float
    seconds: float
    spans: tuple[Span, ...]

    def lanes(self) -> dict[str, list[Span]]:
        """Spans per lane, in time order."""
        out: dict[str, list[Span]] = defaultdict(list)
        for span in sorted(self.spans, key=lambda s: (s.start, s.end)):
            out[span.lane].append(span)
        return dict(out)

    def overlaps(self) -> list[tuple[Span, Span]]:
        """Pairs of spans of one lane that overlap (none: a lane does one thing at a time)."""
        return [(a, b) for spans in self.lanes().values() for a, b in zip(spans, spans[1:]) if b.start < a.end]

    @property
    def covered(self) -> float:
        """The fraction of the step during which some lane was busy."""
        busy, reach = 0.0, 0.0
        for span in sorted(self.spans, key=lambda s: s.start):
            start = max(span.start, reach)
            if span.end > start:
                busy += span.end - start
                reach = span.end
        return busy / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "seconds": self.seconds,
                "spans": [[s.lane, s.phase.value, s.round, s.start, s.end] for s in self.spans]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepTimeline:
        spans = tuple(Span(str(lane), Phase(phase), int(r), float(a), float(b))
                      for lane, phase, r, a, b in data["spans"])
        return cls(float(data["start"]), float(data["seconds"]), spans)


class Timeline:
    """Records one step's spans on one rank (see the module doc); :meth:`finish` resolves them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.round = -1
        """The round the executor is posting now (the transport labels its spans with it)."""
        self.phase = Phase.TRANSFER
        """What the executor's exchange of that round does (:attr:`Phase.TRANSFER` or :attr:`Phase.FORWARD`)."""
        self._raw: list[tuple[str, Phase, int, Stamp, Stamp]] = []
        self._t0 = 0.0
        self._e0: torch.cuda.Event | None = None
        self._stream_lanes: dict[int, str] = {}

    def begin(self) -> None:
        """The step starts now."""
        self._raw = []
        self.round = -1
        self._t0 = time.perf_counter()
        if self.cuda:
            self._e0 = self._event(torch.cuda.current_stream(self.device))

    def stamp(self, stream: torch.cuda.Stream | None = None) -> Stamp:
        """Now on the host (CPU), or an event recorded on ``stream`` (CUDA)."""
        if not self.cuda:
            return time.perf_counter()
        return self._event(stream)

    @staticmethod
    def _event(stream: torch.cuda.Stream | None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add(self, lane: str, phase: Phase, round: int, start: Stamp, end: Stamp) -> None:
        self._raw.append((lane, phase, round, start, end))

    def transferred(self, stream: torch.cuda.Stream, start: Stamp, end: Stamp) -> None:
        """A transport's span of the current round on ``stream`` (one lane per stream, by first use)."""
        lane = self._stream_lanes.setdefault(id(stream), f"transfer {len(self._stream_lanes)}")
        self.add(lane, Phase.HEADER if self.round < 0 else self.phase, self.round, start, end)

    def observe(self, fence: Fence, lane: str, phase: Phase, round: int, posted: float) -> Fence:
        """On the host path: ``fence``, whose completion (when first seen) ends a span begun at ``posted``."""
        return _Observed(fence, self, lane, phase, round, posted)

    def finish(self) -> StepTimeline:
        """The step ended: resolve every stamp (waits for recorded CUDA events) into spans."""
        end = time.perf_counter()
        spans = []
        for lane, phase, r, a, b in self._raw:
            spans.append(Span(lane, phase, r, self._seconds(a), self._seconds(b)))
        seconds = end - self._t0
        if self.cuda:
            last = self._event(torch.cuda.current_stream(self.device))
            last.synchronize()
            seconds = max(seconds, self._seconds(last))
        return StepTimeline(self._t0, seconds, tuple(_serialized(spans)))

    def _seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self._t0
        assert self._e0 is not None
        stamp.synchronize()
        return self._e0.elapsed_time(stamp) / 1e3


def _serialized(spans: list[Span]) -> list[Span]:
    """Within a lane, a span starts no earlier than the one before it ended (host-observed transfers
    are in order; CUDA spans of one stream already are)."""
    out = []
    for lane_spans in _by_lane(spans).values():
        reach = 0.0
        for span in lane_spans:
            start = max(span.start, reach)
            end = max(span.end, start)
            out.append(Span(span.lane, span.phase, span.round, start, end))
            reach = end
    return out


def _by_lane(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: (s.round, s.start)):
        out[span.lane].append(span)
    return out


@dataclass(frozen=True)
class Mark:
    """Record the copies a lane runs as ``phase`` of ``round`` on ``timeline`` (lane ``"copy"``)."""

    timeline: Timeline
    phase: Phase
    round: int


class _Observed(Fence):
    """A host-path fence that records when it was first seen complete."""

    def __init__(self, fence: Fence, timeline: Timeline, lane: str, phase: Phase, round: int, posted: float) -> None:
        self.fence, self.timeline = fence, timeline
        self.span = (lane, phase, round, posted)
        self.seen = False

    def _done(self) -> None:
        if not self.seen:
            self.seen = True
            lane, phase, round, posted = self.span
            self.timeline.add(lane, phase, round, posted, time.perf_counter())

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.fence.wait(stream)
        self._done()

    def synchronize(self, timeout_s: float) -> None:
        self.fence.synchronize(timeout_s)
        self._done()


# -- colocated step trace (``RefitOptions(step_trace=True)``) --------------------------------------------------------


@dataclass
class StepTrace:
    """One rank's record of one colocated step (mutable while the step runs)."""

    marks: dict[str, float] = field(default_factory=dict)
    """Host timestamps (seconds, ``time.perf_counter``) by name."""
    gpu_ms: dict[str, float] = field(default_factory=dict)
    """Device milliseconds by phase (gen rank on CUDA only)."""

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def device_phases(self, queued: torch.cuda.Event, marks: list[tuple[str, torch.cuda.Event]]) -> None:
        """Fill :attr:`gpu_ms` from ``queued`` (recorded before the stream's waits) and the copy
        program's ``[("begin", e), (group, e), ...]`` events; all must have completed."""
        if not marks:
            return
        self.gpu_ms["wait"] = queued.elapsed_time(marks[0][1])
        for (_, before), (name, after) in zip(marks, marks[1:]):
            self.gpu_ms[name] = before.elapsed_time(after)
        self.gpu_ms["copies"] = marks[0][1].elapsed_time(marks[-1][1])


def breakdown(train: StepTrace, gen: StepTrace) -> dict[str, float]:
    """One step of a colocated pair split into phases, in milliseconds (the two traces of one step).

    ``check``: the trainer's moved-parameter check (before *ready*, or after it with ``overlap_check``,
    then off the critical path); ``post``: writing *ready*;
    ``signal``: *ready* written -> the engine has read and checked it; ``enqueue``: the engine's host
    time queueing its copies; ``device_wait``/``device_<group>``: device time (CUDA); ``tail``: the
    copies' end (estimated: queueing began + device wait + copies) -> the engine saw it (``observe``)
    -> the trainer read *done* (``ack``); ``after``: the trainer's own work after *done*; ``total``.
    """
    t, g = train.marks, gen.marks
    if t["checked"] <= t["posted"]:  # the check, then *ready*
        check, post = t["checked"] - t["start"], t["posted"] - t["checked"]
    else:  # overlap_check: *ready* first, the check while the engine copies
        check, post = t["checked"] - t["posted"], t["posted"] - t["start"]
    ms = {"total": t["end"] - t["start"], "check": check, "post": post,
          "signal": g["ready_seen"] - t["posted"], "enqueue": g["enqueued"] - g["ready_seen"],
          "ack": t["done_seen"] - g["gpu_done_seen"], "after": t["end"] - t["done_seen"]}
    out = {k: 1000 * v for k, v in ms.items()}
    if gen.gpu_ms:
        for name, value in gen.gpu_ms.items():
            out[f"device_{name}"] = value
        gpu_end = 1000 * g["enqueue_begin"] + gen.gpu_ms["wait"] + gen.gpu_ms["copies"]
        out["observe"] = 1000 * g["gpu_done_seen"] - gpu_end
        out["tail"] = 1000 * t["done_seen"] - gpu_end
    else:
        out["observe"] = 1000 * (g["gpu_done_seen"] - g["enqueued"])
    return out


__all__ = ["Mark", "Phase", "SetupClock", "SetupTimes", "Span", "StepTimeline", "StepTrace", "Timeline", "breakdown"]
