"""Seeing a lost peer while a step's messages are in flight.

A transport's wait on a peer can outlive that peer: gloo never completes nor fails a message a dead
peer left half transferred (its pair error reaches only operations not yet started), so the wait
would end only at its timeout; NCCL has no notion of a dead process at all. So while a wait is slow,
the transport asks a :class:`PeerWatch` every so often (first after :data:`FIRST_CHECK_S`, then at
most every :data:`MAX_CHECK_S`) whether the step is lost, and stops with a
:class:`~refit_core.contract.errors.TransferError` naming the rank if it is.

:class:`StoreWatch` answers from the rendezvous store: a rank whose store connection closed without a
goodbye is *gone* (it exited or was killed), and a rank whose transport gave up on a step publishes
why under :data:`TRANSPORT_FAILED` (the first one wins), so that ranks waiting on it, which may be waiting
on half a message from it, stop too. Each check costs two O(1) store requests (the failure key, the
awaited peer's *gone* record); a healthy step whose waits end within :data:`FIRST_CHECK_S` makes none.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from refit_core.contract.side import Side
from refit_core.net.keys import TRANSPORT_FAILED, RankId, gone_key

FIRST_CHECK_S = 0.25
"""How long a wait runs before the transport first asks its watch."""
MAX_CHECK_S = 1.0
"""The longest interval between two questions to the watch."""
REASON_CHARS = 400
"""How much of a rank's reason for giving up the store keeps."""
STORE_LOSS_GRACE_S = 2.0
"""How long a wait on a rank other than the store's host goes on once the store is unreachable."""


@dataclass(frozen=True)
class PeerLoss:
    """Why the current step cannot finish: ``rank`` (a global rank) is gone or gave up, for ``reason``."""

    rank: int
    reason: str

    def describe(self, names: RankNames) -> str:
        who = f"rank {self.rank} ({names.name(self.rank)})" if self.rank >= 0 else "a rank"
        return f"{who} {self.reason}"


@dataclass(frozen=True)
class RankNames:
    """Global ranks (train ranks first, then gen ranks) as the store and errors name them."""

    train: int
    """The train side's world size."""

    def rank_id(self, rank: int) -> RankId:
        return RankId(Side.TRAIN, rank) if rank < self.train else RankId(Side.GEN, rank - self.train)

    def name(self, rank: int) -> str:
        return self.rank_id(rank).name

    def global_rank(self, who: RankId) -> int:
        return who.rank if who.side is Side.TRAIN else self.train + who.rank


class PeerWatch(Protocol):
    """What a transport asks while a wait is slow."""

    names: RankNames

    def lost(self, peer: int) -> PeerLoss | None:
        """The loss that dooms the current step (``peer``, the one waited on, is gone, or any rank gave
        up), or None (none known: an unreachable store dooms only a wait on its host)."""

    def give_up(self, rank: int, reason: str) -> None:
        """Rank ``rank`` (this one) gives up on the current step: tell the others (best effort)."""


class StoreWatch:
    """A :class:`PeerWatch` over the rendezvous store (the refit's :class:`~refit_core.net.store.StoreClient`).

    An unreachable store dooms a wait on its host (train rank 0) at once, and a wait on any other rank
    once the store has been unreachable for ``store_loss_grace_s``: a trainer may end right after its
    last send while the other ranks' messages are still arriving.
    """

    def __init__(self, store: dist.Store, sizes: Mapping[Side, int],
                 store_loss_grace_s: float = STORE_LOSS_GRACE_S) -> None:
        self.store = store
        self.names = RankNames(sizes[Side.TRAIN])
        self.store_loss_grace_s = store_loss_grace_s
        self._store_lost_at: float | None = None  # when a check first found the store unreachable

    def lost(self, peer: int) -> PeerLoss | None:
        try:
            if self.store.check([TRANSPORT_FAILED]):
                rank, _, reason = bytes(self.store.get(TRANSPORT_FAILED)).decode(errors="replace").partition(" ")
                return PeerLoss(int(rank) if rank.isdigit() else -1, f"gave up on the step: {reason[:REASON_CHARS]}")
            if self.store.check([gone_key(self.names.rank_id(peer))]):
                return PeerLoss(peer, "is gone: its connection to the rendezvous closed without a goodbye "
                                      "(it exited or was killed)")
        except RuntimeError as exc:  # RefitError too: the store's host (train rank 0) is unreachable
            now = time.monotonic()
            if self._store_lost_at is None:
                self._store_lost_at = now
            if peer == 0 or now - self._store_lost_at >= self.store_loss_grace_s:
                return PeerLoss(0, f"hosts the rendezvous, which is unreachable ({str(exc)[:REASON_CHARS]})")
        return None

    def give_up(self, rank: int, reason: str) -> None:
        try:
            self.store.compare_set(TRANSPORT_FAILED, "", f"{rank} {reason[:REASON_CHARS]}")
        except RuntimeError:  # RefitError too; best effort: the store's host may be gone already
            pass


__all__ = ["FIRST_CHECK_S", "MAX_CHECK_S", "STORE_LOSS_GRACE_S", "PeerLoss", "PeerWatch", "RankNames", "StoreWatch"]
