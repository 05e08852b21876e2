"""Where copies run: synchronously on the host (CPU), or on a CUDA side stream with events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .errors import TransferError
from .transport.base import DoneFence, Fence


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
        deadline = time.monotonic() + timeout_s
        while not self.event.query():
            if time.monotonic() > deadline:
                raise TransferError(f"{self.what} did not complete within {timeout_s:.0f} s "
                                    "(a peer died or hung)")
            time.sleep(1e-4)


def record(stream: torch.cuda.Stream, what: str) -> EventFence:
    event = torch.cuda.Event()
    event.record(stream)
    return EventFence(event, what)


class Lane:
    """Runs batches of copies after fences; returns a fence for their completion."""

    def run(self, copies: Callable[[], None], after: Sequence[Fence] = ()) -> Fence:
        for fence in after:
            fence.wait()
        copies()
        return DoneFence()

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


class StreamLane(Lane):
    """Copies on a dedicated CUDA stream, ordered against other streams by events only."""

    def __init__(self, device: torch.device, what: str) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.what = what

    def run(self, copies: Callable[[], None], after: Sequence[Fence] = ()) -> Fence:
        for fence in after:
            fence.wait(self.stream)
        with torch.cuda.stream(self.stream):
            copies()
        return record(self.stream, self.what)


def lane_for(device: torch.device, what: str) -> Lane:
    return StreamLane(device, what) if device.type == "cuda" else Lane()
