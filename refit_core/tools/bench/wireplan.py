"""The wire of a multi-rank run: the same bytes over the same (train rank, gen rank) pairs as refit.

``refit bench`` divides refit's time by the wire's; with several ranks that is a bound only if the
wire moves what refit moves, pair by pair, all pairs at once. The plan is read off refit's schedule
(its messages' bytes per pair); :class:`WirePlan` keeps it, and the wire method moves it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WirePair:
    """``nbytes`` from train rank ``src`` to gen rank ``dst`` (global rank numbers)."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class WirePlan:
    """Every pair the wire moves, in one order every rank agrees on (sorted: deadlock-free when each
    rank posts its pairs in turn, since senders only send and receivers only receive)."""

    pairs: tuple[WirePair, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pairs)

    def of_rank(self, rank: int) -> tuple[WirePair, ...]:
        return tuple(p for p in self.pairs if rank in (p.src, p.dst))

    def to_json(self) -> list[list[int]]:
        return [[p.src, p.dst, p.nbytes] for p in self.pairs]

    @classmethod
    def from_json(cls, data: Iterable[Iterable[int]]) -> WirePlan:
        return cls(tuple(WirePair(*map(int, p)) for p in data))


def wire_plan(messages: Iterable[tuple[int, int, int]], num_train: int) -> WirePlan:
    """The plan of refit's ``(src train rank, dst gen rank within the gen side, bytes)`` messages.

    Pairs are summed and named by global rank (gen ranks follow the ``num_train`` train ranks)."""
    by_pair: dict[tuple[int, int], int] = {}
    for src, dst, nbytes in messages:
        key = (src, num_train + dst)
        by_pair[key] = by_pair.get(key, 0) + nbytes
    return WirePlan(tuple(WirePair(s, d, n) for (s, d), n in sorted(by_pair.items()) if n))


def schedule_plan(schedule: Any, num_train: int) -> WirePlan:
    """The plan of a refit :class:`~refit_core.plan.schedule.Schedule` (every round's messages)."""
    return wire_plan(((m.src, m.dst, m.nbytes) for msgs in schedule.rounds for m in msgs), num_train)


def single_pair(src: int, dst: int, nbytes: int) -> WirePlan:
    """One pair moving ``nbytes`` (a one-to-one run: the model's bytes)."""
    return WirePlan((WirePair(src, dst, nbytes),))
