"""The copy bound: one device copy of a model's bytes, chunk after chunk, the ceiling of work that copies
every byte once on one GPU (a colocated step, a staged commit). ``refit bench`` and its colocated and peer
runs time against it."""

from __future__ import annotations

import time

import torch

BOUND_WARMUP = 3
"""Untimed copies of all the bytes before the copy bound's first sample."""
MIN_BOUND_SAMPLES = 10
"""The copy bound is the median of at least this many timed copies of all the bytes."""


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        sync_device(self.device)
        start = time.perf_counter()
        self.copy()
        sync_device(self.device)
        self.samples.append(time.perf_counter() - start)

    def top_up(self, count: int = MIN_BOUND_SAMPLES) -> None:
        while len(self.samples) < count:
            self.sample()

    def close(self) -> None:
        del self.src, self.dst


__all__ = ["BOUND_WARMUP", "MIN_BOUND_SAMPLES", "CopyBound", "sync_device"]
