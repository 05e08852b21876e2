"""A running fleet's view from outside (``refit status``): read what train rank 0 last published, as an observer
that proves the job's secret, and print it."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from refit_core.contract.env import with_overrides
from refit_core.contract.options import RefitOptions
from refit_core.fleet.records import JOINS, STATE, ReplicaState
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous

STATUS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class FleetStatus:
    """A running fleet from outside: its replicas as train rank 0 last published them (after its last step;
    empty before the first), and how many join requests its ranks have made so far (each rank of a joining
    replica makes one; train rank 0 answers them at the start of its next step)."""

    replicas: tuple[ReplicaState, ...]
    join_requests: int


def read_fleet(address: str, options: RefitOptions | None = None, timeout_s: float = STATUS_TIMEOUT_S) -> FleetStatus:
    """The fleet at ``address`` now. ``options`` carry the job's name and secret (the environment's
    ``REFIT_SECRET`` applies)."""
    options = with_overrides(options or RefitOptions())
    credentials = JobCredentials.required(options, "refit status")
    rdv = Rendezvous(address, host=False, who=f"observer/status-{os.getpid()}/0", timeout_s=timeout_s,
                     credentials=credentials)
    try:
        wire, joins = rdv.read(STATE, default=[]), rdv.read(JOINS, default=0)
    finally:
        rdv.close()
    replicas = tuple(ReplicaState.from_wire(s) for s in wire) if isinstance(wire, list) else ()
    return FleetStatus(replicas, joins if type(joins) is int else 0)


def fleet_table(states: Sequence[ReplicaState], now: float | None = None) -> str:
    """``states`` as a table: each replica's name, ranks, version, how long ago it joined, who feeds it
    (``trainers`` or its feeder replica), layout, last error."""
    now = time.time() if now is None else now
    rows = [("replica", "ranks", "version", "joined", "fed by", "layout", "last error")]
    for s in states:
        rows.append((s.replica, str(s.gen_ranks), "-" if s.version is None else str(s.version),
                     f"{max(0.0, now - s.joined_at):.0f} s ago", s.feeder or "trainers", s.layout or "-",
                     (s.last_error or "-")[:100]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


__all__ = ["FleetStatus", "fleet_table", "read_fleet"]
