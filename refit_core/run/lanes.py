"""Where copies run: synchronously on the host (CPU), or on a CUDA side stream with events.

A *lane* runs batches of copies after fences and returns a fence for their completion. On CUDA the
lane is a dedicated stream, ordered against the transport's stream and the caller's stream by events
only, so packing of round k+1 runs while round k is on the wire and round k-1 is being unpacked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from refit_core.net.transport.base import DoneFence, Fence, spin_until

if TYPE_CHECKING:
    from refit_core.run.timing import Mark

COPY_LANE = "copy"


class EventFence(Fence):
    """Completion of work recorded on a CUDA stream."""

    def __init__(self, event: torch.cuda.Event, what: str) -> None:
        self.event = event
        self.what = what

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        if stream is None:
            self.event.synchronize()
        else:
            stream.wait_event(self.event)

    def synchronize(self, timeout_s: float) -> None:
        spin_until(self.event.query, timeout_s, self.what)


def record(stream: torch.cuda.Stream, what: str) -> EventFence:
    """A fence for the work queued on ``stream`` so far."""
    event = torch.cuda.Event()
    event.record(stream)
    return EventFence(event, what)


def current_work(device: torch.device, what: str = "the caller's pending work") -> Fence:
    """A fence for everything already queued on ``device``'s current stream (CPU: nothing).

    Refit's own streams wait on it first, so that packing never reads weights an optimizer step is
    still writing and a zero-copy receive never overwrites weights a running forward still reads.
    """
    if device.type != "cuda":
        return DoneFence()
    return record(torch.cuda.current_stream(device), what)


class Lane:
    """Runs batches of copies after fences; returns a fence for their completion."""

    def run(self, copies: Callable[[], None], after: Sequence[Fence | None] = (), mark: Mark | None = None) -> Fence:
        """Run ``copies`` once ``after`` completed; ``mark`` records them on a timeline."""
        for fence in after:
            if fence is not None:
                fence.wait()
        start = mark.timeline.stamp() if mark is not None else None
        copies()
        if mark is not None and start is not None:
            mark.timeline.add(COPY_LANE, mark.phase, mark.round, start, mark.timeline.stamp())
        return DoneFence()

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


class StreamLane(Lane):
    """Copies on a dedicated CUDA stream, ordered against other streams by events only."""

    def __init__(self, device: torch.device, what: str) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.what = what

    def run(self, copies: Callable[[], None], after: Sequence[Fence | None] = (), mark: Mark | None = None) -> Fence:
        for fence in after:
            if fence is not None:
                fence.wait(self.stream)
        start = mark.timeline.stamp(self.stream) if mark is not None else None
        with torch.cuda.stream(self.stream):
            copies()
        if mark is not None and start is not None:
            mark.timeline.add(COPY_LANE, mark.phase, mark.round, start, mark.timeline.stamp(self.stream))
        return record(self.stream, self.what)


def lane_for(device: torch.device, what: str) -> Lane:
    """A stream lane on CUDA, the synchronous host lane elsewhere."""
    return StreamLane(device, what) if device.type == "cuda" else Lane()
