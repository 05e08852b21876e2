"""A replica that feeds another: :class:`MirrorSender` runs on every rank of a feeder replica and sends what that
rank's engine landed (its receiver's destination pieces, as source pieces) to the same rank of a child replica of
the same layout, through the planner and executor of any refit job. The child's weights are the feeder's bytes,
so they equal the trainers' bit for bit. Engines with a loader path or quantized destinations hold something else
than what the trainers sent, and never feed (:func:`layout_digest` is "" for them)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationMap, Piece, SourcePiece
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.fleet.jobs import JobSender
from refit_core.fleet.records import Member
from refit_core.plan.planning import PlanCache


def layout_digest(mapping: DestinationMap) -> str:
    """The digest of what an engine rank holds (every piece's tensor, shape, dtype and box, in order); replicas
    whose ranks hold the same can feed each other. "" when it cannot feed: a loader path or quantized pieces."""
    if mapping.loader or any(p.spec.quant is not None for p in mapping.pieces):
        return ""
    digest = hashlib.sha256()
    for p in mapping.pieces:
        digest.update(f"{p.spec.name}|{p.spec.shape}|{p.spec.dtype}|{p.box.offsets}|{p.box.sizes};".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class FedWeights:
    """A mirror's model: the weights feeder replica ``replica`` landed (no plugin knows it, so its memory is checked
    piece by piece each step)."""

    replica: str
    receiver: RefitReceiver = field(repr=False)


class MirrorSender(JobSender):
    """Rank ``receiver.rank`` of a feeder replica, feeding child ``member`` the pieces ``receiver`` landed. The
    feeder's rank 0 hosts the job's store at ``rendezvous`` and plans it (plans of one layout come from its
    cache, ``plans``); ``options`` are the feeder's agreed settings."""

    def __init__(self, receiver: RefitReceiver, *, replica: str, member: Member, rendezvous: str,
                 options: RefitOptions, fleet_present: Callable[[], Collection[str]] | None,
                 plans: PlanCache | None = None) -> None:
        super().__init__(FedWeights(replica, receiver), member=member, fleet_present=fleet_present,
                         rendezvous=rendezvous, rank=receiver.rank, world_size=receiver.world_size, options=options,
                         plugins=receiver.plugins, host_id=receiver.host_id, plan_cache=plans)
        self._receiver = receiver
        self.store_host = f"replica {replica} rank 0 (the feeder)"

    def _local_pieces(self) -> list[Piece]:
        return [SourcePiece(p.spec, p.box, p.view) for p in self._receiver.held_pieces()]


__all__ = ["FedWeights", "MirrorSender", "layout_digest"]
