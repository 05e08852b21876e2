"""The copy bound: one device copy of a model's bytes, chunk after chunk, the ceiling of work that copies
every byte once on one GPU (a colocated step, a staged commit). ``refit bench`` and its colocated and peer
runs time against it. Also the synchronized clock it and the GPU benchmark scripts time with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

BOUND_WARMUP = 3
"""Untimed copies of all the bytes before the copy bound's first sample."""
MIN_BOUND_SAMPLES = 10
"""The copy bound is the median of at least this many timed copies of all the bytes."""


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(fn: Callable[[], None], device: torch.device) -> float:
    """The wall time of ``fn`` and the device work it queues (``device`` drained before and after)."""
    sync_device(device)
    start = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], None], iters: int, device: torch.device, *, warmup: int) -> float:
    """The median of ``iters`` :func:`seconds_of` runs of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds_of(fn, device) for _ in range(iters))


class CopyBound:
    """One device copy of ``nbytes`` through two buffers of ``min(nbytes, max_bytes)`` (chunk after
    chunk, timed as one copy); :meth:`sample` times one more. Warm from construction on."""

    def __init__(self, nbytes: int, device: torch.device, max_bytes: int) -> None:
        self.nbytes, self.device = nbytes, device
        self.chunk = max(1, min(nbytes, max_bytes))
        self.src = torch.zeros(self.chunk, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.samples: list[float] = []
        for _ in range(BOUND_WARMUP):
            self.copy()
        sync_device(device)

    def copy(self) -> None:
        """Queue one copy of all the bytes (chunk after chunk) on the current stream."""
        for start in range(0, self.nbytes, self.chunk):
            n = min(self.chunk, self.nbytes - start)
            self.dst[:n].copy_(self.src[:n])

    def sample(self) -> None:
        self.samples.append(seconds_of(self.copy, self.device))

    def top_up(self, count: int = MIN_BOUND_SAMPLES) -> None:
        while len(self.samples) < count:
            self.sample()

    def close(self) -> None:
        del self.src, self.dst


__all__ = ["BOUND_WARMUP", "MIN_BOUND_SAMPLES", "CopyBound", "median_seconds", "seconds_of", "sync_device"]
