"""Barriers and small signals between a colocated run's two processes, through a TCPStore."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


class PairSync:
    """Barriers and small signals between the two processes (trainer rank 0, engine rank 1)."""

    def __init__(self, address: str, rank: int, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.rank = rank
        self.rounds = 0

    def barrier(self) -> None:
        """Wait for the other process; each call is the next barrier (``rounds`` counts them)."""
        key = f"barrier/{self.rounds}"
        self.rounds += 1
        self.store.add(key, 1)
        while self.store.add(key, 0) < 2:
            time.sleep(0.0002)
        self.store.add(key, 1)  # seen: the store's host (rank 0) must not exit before its peer got here
        while self.rank == 0 and self.store.add(key, 0) < 4:
            time.sleep(0.0002)

    def signal(self, key: str, value: bytes = b"1") -> None:
        """Post ``value`` under ``key`` for the other process to :meth:`take`."""
        self.store.set(key, value)  # type: ignore[arg-type]  # torch's stub says str; bytes are stored as is

    def take(self, key: str) -> bytes:
        """Wait for ``key``'s value, remove it and return it."""
        self.store.wait([key])
        value = self.store.get(key)
        self.store.delete_key(key)
        return value


__all__ = ["PairSync"]
