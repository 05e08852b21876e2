"""Where a step's time goes on one rank: pack / transfer / unpack spans per lane, for ``refit bench --timeline``.

An executor given a :class:`Timeline` records, for one step, the header exchange, every round's
packing (sender) or unpacking (receiver) on the copy lane, and every round's transfer. On CUDA the
spans are CUDA events recorded on the stream that runs the work (the copy lane's stream, each NCCL
communicator's stream: one lane per stream), resolved after the step; on CPU they are
``time.perf_counter`` stamps: copies run on the host, and a gloo transfer is drawn from when it was
posted (or the previous round's transfer ended, whichever is later: gloo delivers a pair's messages
in order) to when the host saw it complete. Spans of one lane never overlap; times are seconds from
the step's start, and :attr:`StepTimeline.start` (``perf_counter``, one clock for every process of a
machine) lines up ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from refit_core.net.transport.base import Fence


class Phase(StrEnum):
    """What a span of a lane was doing."""

    HEADER = "header"
    PACK = "pack"
    TRANSFER = "transfer"
    UNPACK = "unpack"


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


Stamp = float | torch.cuda.Event


class Timeline:
    """Records one step's spans on one rank (see the module doc); :meth:`finish` resolves them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.round = -1
        """The round the executor is posting now (the transport labels its spans with it)."""
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
        self.add(lane, Phase.HEADER if self.round < 0 else Phase.TRANSFER, self.round, start, end)

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


__all__ = ["Mark", "Phase", "Span", "StepTimeline", "Timeline"]
