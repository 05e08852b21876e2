"""What a fleet's ranks tell each other through its store, and what ``RefitFleet`` reports: frozen records, JSON
on the wire (never pickle), each checked as it is read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from refit_core.contract.errors import WireError

REPLICA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A replica's name: what its ranks' store identities (``replica/NAME/RANK``) and every report call it."""

LEADER = "train/0"
"""The store identity of train rank 0, which hosts the fleet's store and decides each step's members."""
JOINS = "fleet/joins"
"""The counter a joining rank draws its ticket from (:func:`join_key`)."""
STATE = "fleet/state"
"""The fleet's view (:class:`ReplicaState` per replica), as train rank 0 last published it (``refit status``)."""


def replica_identity(replica: str, rank: int) -> str:
    """The fleet's store identity of rank ``rank`` of replica ``replica``, while it joins."""
    return f"replica/{replica}/{rank}"


def join_key(ticket: int) -> str:
    """A joining rank's :class:`JoinRequest`, under the ticket it drew."""
    return f"fleet/join/{ticket}"


def admit_key(ticket: int) -> str:
    """Train rank 0's answer to ticket ``ticket``: an :class:`Admission`."""
    return f"fleet/admit/{ticket}"


def start_key(step: int) -> str:
    """In a replica's own job's store: train rank 0 starts that job's step ``step`` now (its version)."""
    return f"fleet/start/{step}"


def outcome_key(step: int) -> str:
    """Which replicas landed fleet step ``step`` and which failed it, as train rank 0 judged (every train rank
    reports that)."""
    return f"fleet/outcome/{step}"


def members_key(step: int) -> str:
    """The replicas step ``step`` fans out to (a list of :class:`Member`), as train rank 0 decided."""
    return f"fleet/members/{step}"


def check_name(name: object) -> str:
    """``name`` if it is a valid replica name; :class:`ValueError` naming the rule otherwise."""
    if not isinstance(name, str) or REPLICA_NAME.fullmatch(name) is None:
        raise ValueError(f"replica name {name!r:.80}: 1 to 64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return name


def _field(data: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise WireError(f"{what}: field {key!r} is {value!r:.40}")
    return value


@dataclass(frozen=True)
class JoinRequest:
    """Rank ``rank`` of replica ``replica`` (``gen_ranks`` ranks in all) asks to join, under ``ticket``."""

    replica: str
    rank: int
    gen_ranks: int
    ticket: int

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica, "rank": self.rank, "gen_ranks": self.gen_ranks}

    @classmethod
    def from_wire(cls, ticket: int, data: Any) -> JoinRequest:
        what = f"join request {ticket}"
        replica = _field(data, "replica", str, what)
        rank, gen_ranks = _field(data, "rank", int, what), _field(data, "gen_ranks", int, what)
        try:
            check_name(replica)
        except ValueError as exc:
            raise WireError(f"{what}: {exc}") from None
        if not 0 <= rank < gen_ranks <= 1 << 16:
            raise WireError(f"{what}: rank {rank} of {gen_ranks}")
        return cls(replica, rank, gen_ranks, ticket)


@dataclass(frozen=True)
class Member:
    """A replica the trainers fan out to: its name, the address of its own refit job with the trainers, its
    ranks, and the ticket of its rank 0's join (another ticket under the same name: it restarted)."""

    replica: str
    address: str
    gen_ranks: int
    incarnation: int

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica, "address": self.address, "gen_ranks": self.gen_ranks,
                "incarnation": self.incarnation}

    @classmethod
    def from_wire(cls, data: Any) -> Member:
        what = "a fleet member"
        return cls(_field(data, "replica", str, what), _field(data, "address", str, what),
                   _field(data, "gen_ranks", int, what), _field(data, "incarnation", int, what))


@dataclass(frozen=True)
class Admission:
    """Train rank 0's answer to a join: the address to set up against, or why the join is refused (None:
    admitted)."""

    address: str | None
    refused: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"address": self.address, "refused": self.refused}

    @classmethod
    def from_wire(cls, data: Any) -> Admission:
        refused = data.get("refused") if isinstance(data, dict) else None
        address = data.get("address") if isinstance(data, dict) else None
        if not (isinstance(refused, str) and address is None or isinstance(address, str) and refused is None):
            raise WireError(f"a fleet admission: {data!r:.80}")
        return cls(address, refused)


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the fleet sees it: its name, its ranks, the version it holds (None: none yet), when it
    joined (seconds since the epoch), its layout (the fingerprint of the plan its job runs; replicas with one
    layout share one plan; "" before its first setup) and the error of its last failed step (None: none)."""

    replica: str
    gen_ranks: int
    version: int | None
    joined_at: float
    layout: str = ""
    last_error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica, "gen_ranks": self.gen_ranks, "version": self.version,
                "joined_at": self.joined_at, "layout": self.layout, "last_error": self.last_error}

    @classmethod
    def from_wire(cls, data: Any) -> ReplicaState:
        what = "a fleet state"
        version, error = data.get("version"), data.get("last_error")
        if version is not None and type(version) is not int or error is not None and not isinstance(error, str):
            raise WireError(f"{what}: {data!r:.80}")
        return cls(_field(data, "replica", str, what), _field(data, "gen_ranks", int, what), version,
                   float(_field(data, "joined_at", (int, float), what)), _field(data, "layout", str, what), error)


@dataclass(frozen=True)
class ReplicaFailure:
    """A replica that did not get a step, and why (it was dropped: it must join again)."""

    replica: str
    reason: str


@dataclass(frozen=True)
class FleetStep:
    """One ``RefitFleet.send()``: the step and version, the replicas that hold that version now (``landed``),
    those that joined for it, and those that failed it (each dropped until it joins again)."""

    step: int
    version: int
    landed: tuple[str, ...]
    joined: tuple[str, ...] = ()
    failed: tuple[ReplicaFailure, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no replica failed the step (False: :attr:`failed` names them)."""
        return not self.failed


__all__ = ["JOINS", "LEADER", "REPLICA_NAME", "STATE", "Admission", "FleetStep", "JoinRequest", "Member",
           "ReplicaFailure", "ReplicaState", "admit_key", "check_name", "join_key", "members_key", "outcome_key",
           "start_key"]
