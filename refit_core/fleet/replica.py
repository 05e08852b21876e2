"""The gen side of a fleet: :func:`join_fleet`, every rank of a replica, to join the running job (or join it
again after a crash or a failed step)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions
from refit_core.contract.plugins import PluginManager
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.run.executor import StepStats
from refit_core.fleet.records import (
    JOINS,
    LEADER,
    Admission,
    JoinRequest,
    admit_key,
    check_name,
    join_key,
    replica_identity,
    start_key,
)
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous

JOIN_TIMEOUT_S = 600.0
"""How long a joining rank waits, by default, for the trainers' next step to admit its replica."""


class ReplicaReceiver(RefitReceiver):
    """A rank of a fleet's replica: ``receive()`` first waits, without a deadline, until train rank 0 announces
    the step in the replica's job (a replica idles between steps as long as training takes, and the trainers
    reach the replicas one after another); the step's deadline counts from then. Train rank 0 leaving, or
    dropping this replica (its job's store closes), ends the wait with an error."""

    def receive(self, *, only: Iterable[str] | None = None) -> StepStats:
        if self.settings is not None and self._rdv is not None and self._broken is None:
            self._rdv.wait([start_key(self._steps)], f"train rank 0 to start step {self._steps}", timeout_s=math.inf,
                           watched={LEADER})
        return super().receive(only=only)


def join_fleet(engine: Any, *, fleet: str, replica: str, rank: int, world_size: int,
               options: RefitOptions | None = None, plugins: PluginManager | None = None, host_id: str | None = None,
               join_timeout_s: float = JOIN_TIMEOUT_S) -> RefitReceiver:
    """Join rank ``rank`` of replica ``replica`` (``world_size`` ranks) to the fleet whose store is at ``fleet``.

    Returns this rank's :class:`ReplicaReceiver` (a :class:`~refit_core.RefitReceiver`), set up: its next
    ``receive()`` is the step that admitted the replica, whole, and waits for train rank 0 to start each step.
    Train rank 0 admits a replica at the start of a step once all its ranks asked, so this waits up to
    ``join_timeout_s`` for that; every rank proves the job's secret
    (``options.secret``). A replica named like one still in the fleet, its ranks connected, is refused by name
    (:class:`~refit_core.RefitError`); one whose ranks died or closed is replaced (a restart). After a failed
    step (``receive()`` raised), ``close()`` the receiver and join again.
    """
    check_name(replica)
    if not 0 <= rank < world_size:
        raise RefitError(f"replica {replica}: rank {rank} of a world of {world_size}")
    options = with_overrides(options or RefitOptions())
    credentials = JobCredentials.required(options, f"replica {replica} rank {rank}")
    rdv = Rendezvous(fleet, host=False, who=replica_identity(replica, rank), timeout_s=options.timeout_s,
                     credentials=credentials)
    try:  # connected to the fleet's store until the job's setup is done: train rank 0 sees a death in between
        ticket = rdv.client.add(JOINS, 1)
        rdv.publish(join_key(ticket), JoinRequest(replica, rank, world_size, ticket).to_wire())
        deadline = time.monotonic() + join_timeout_s
        (answer,) = rdv.wait([admit_key(ticket)], f"the fleet to admit replica {replica} (the trainers' next step)",
                             timeout_s=max(0.0, deadline - time.monotonic()), watched={LEADER})
        admission = Admission.from_wire(answer)
        rdv.client.delete_key(admit_key(ticket))
        if admission.refused is not None or admission.address is None:
            raise RefitError(f"the fleet at {fleet} refused replica {replica} rank {rank}: {admission.refused}")
        receiver = ReplicaReceiver(engine, rendezvous=admission.address, rank=rank, world_size=world_size,
                                   options=options, plugins=plugins, host_id=host_id)
        receiver.setup()
    finally:
        rdv.close()
    return receiver


__all__ = ["JOIN_TIMEOUT_S", "ReplicaReceiver", "join_fleet"]
