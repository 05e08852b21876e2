"""Lockstep between the ranks of a bench run, through the TCPStore they share."""

from __future__ import annotations

import time

import torch.distributed as dist


class Barrier:
    """A barrier over ``store`` for ``nprocs`` ranks; each call is the next barrier of the run."""

    def __init__(self, store: dist.Store, nprocs: int) -> None:
        self.store, self.nprocs, self.count = store, nprocs, 0

    def __call__(self) -> None:
        self.count += 1
        key = f"barrier/{self.count}"
        if self.store.add(key, 1) == self.nprocs:
            self.store.set(f"{key}/done", "1")
        self.store.wait([f"{key}/done"])

    def leave(self, rank: int) -> None:
        """The store's host (rank 0) returns only after every other rank is done with the store."""
        if rank != 0:
            self.store.add("left", 1)
            return
        while self.store.add("left", 0) < self.nprocs - 1:
            time.sleep(0.01)

    def max(self, key: str, rank: int, value: float) -> float:
        """The largest ``value`` over all ranks (every rank gets the same answer)."""
        self.store.set(f"{key}/{rank}", repr(value))
        self()
        return max(float(self.store.get(f"{key}/{r}").decode()) for r in range(self.nprocs))


__all__ = ["Barrier"]
