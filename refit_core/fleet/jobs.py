"""The feeding side of one replica's job in a fleet: :class:`JobSender`, a :class:`~refit_core.RefitSender` that
announces each step before it moves a byte. The trainers feed a replica through one; a feeder replica feeds one
of its children through one too (:class:`~refit_core.fleet.mirror.MirrorSender`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

from refit_core.contract.side import Side
from refit_core.endpoints.sender import RefitSender
from refit_core.fleet.records import LEADER, Member, StepStart, replica_identity, start_key
from refit_core.net.keys import RankId
from refit_core.net.rendezvous import Abandoned
from refit_core.run.executor import StepStats

KEPT_STEPS = 2
"""Steps whose keys a fleet's stores keep (every rank has read older ones)."""


class JobSender(RefitSender):
    """A feeding rank's part of one replica's job. Its rank 0 announces each step (:attr:`start`, set before
    ``send()``) in the job's store before it moves a byte, and every other rank of the job, feeding or fed, waits
    for that without a deadline: the feeders reach their replicas one after another, and a replica idles between
    steps as long as training takes. Every rank's step deadline counts from the announcement
    (:class:`~refit_core.fleet.replica.ReplicaReceiver` on the replica's ranks). The job's rank 0 leaving ends
    the wait with an error.

    ``fleet_present``: on the job's rank 0, the store identities now in the fleet's store (a joining rank stays
    there until its job's setup is done, and a replica's ranks for as long as they serve).
    """

    def __init__(self, model: Any, *, member: Member, fleet_present: Callable[[], Collection[str]] | None,
                 **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.member = member
        self._fleet_present = fleet_present
        self.start: StepStart | None = None
        """What the next ``send()`` announces (its rank 0 only)."""

    def _abandoned(self) -> Abandoned | None:
        """The job's rank 0, during its setup: the replica's ranks in neither the job's store nor the fleet's died
        after the fleet admitted the replica, before they came: the setup fails now, not at its deadline."""
        job = self._rdv.server if self._rdv is not None else None
        if job is None or self._fleet_present is None or self.settings is not None:  # set up: they came
            return None
        here = set(job.present()) | set(self._fleet_present())
        replica = self.member.replica
        missing = [r for r in range(self.member.gen_ranks)
                   if str(RankId(Side.GEN, r)) not in here and replica_identity(replica, r) not in here]
        if not missing:
            return None
        return Abandoned(frozenset(str(RankId(Side.GEN, r)) for r in missing),
                         f"replica {replica} rank(s) {missing} left after the fleet admitted it, before its job's "
                         "setup was done (it exited or was killed)")

    def send(self, version: int, *, only: Iterable[str] | None = None, reset: bool = False) -> StepStats:
        if self._rdv is not None and self.settings is not None and self._broken is None:
            key = start_key(self._steps)
            if self.plans:
                start = self.start or StepStart(version, self._steps, ())
                self._rdv.publish(key, start.to_wire())
                if self._steps >= KEPT_STEPS:
                    self._rdv.client.delete_key(start_key(self._steps - KEPT_STEPS))
            else:
                self._rdv.wait([key], f"rank 0 of the feeding side to start step {self._steps} of this replica's "
                               "job", timeout_s=math.inf, watched={LEADER})
        return super().send(version, only=only, reset=reset)


__all__ = ["KEPT_STEPS", "JobSender"]
