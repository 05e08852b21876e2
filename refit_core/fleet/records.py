"""What a fleet's ranks tell each other through its store, and what ``RefitFleet`` reports: frozen records, JSON
on the wire (never pickle), each checked as it is read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from refit_core.contract.errors import RefitError, WireError

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


def feed_key(replica: str, incarnation: int) -> str:
    """The address of the job through which a relayed replica (``incarnation``: its :attr:`Member.incarnation`)
    gets its steps: its feeder's rank 0 hosts that job and writes the address here."""
    return f"fleet/feed/{replica}/{incarnation}"


def report_key(step: int, member: Member) -> str:
    """A feeder's rank 0's :class:`FeedReport` on relayed replica ``member`` for fleet step ``step`` (or the
    replica's own, when its feeder stopped answering before the step began there)."""
    return f"fleet/report/{step}/{member.replica}/{member.incarnation}"


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
    """Rank ``rank`` of replica ``replica`` (``gen_ranks`` ranks in all) asks to join, under ``ticket``;
    ``layout``: the digest of what this rank's engine holds (:func:`refit_core.fleet.mirror.layout_digest`; "":
    it cannot feed another replica)."""

    replica: str
    rank: int
    gen_ranks: int
    ticket: int
    layout: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica, "rank": self.rank, "gen_ranks": self.gen_ranks, "layout": self.layout}

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
        layout = data.get("layout", "")
        if not isinstance(layout, str) or len(layout) > 64:
            raise WireError(f"{what}: field 'layout' is {layout!r:.40}")
        return cls(replica, rank, gen_ranks, ticket, layout)


@dataclass(frozen=True)
class Member:
    """A replica of the fleet: its name, the address of its own refit job with the trainers ("" when a feeder
    serves it), its ranks, the ticket of its rank 0's join (another ticket under the same name: it restarted),
    the replica that forwards it each step once it landed it (None: the trainers feed it) and the digest of its
    engines' layout ("": it cannot feed another replica)."""

    replica: str
    address: str
    gen_ranks: int
    incarnation: int
    feeder: str | None = None
    layout: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica, "address": self.address, "gen_ranks": self.gen_ranks,
                "incarnation": self.incarnation, "feeder": self.feeder, "layout": self.layout}

    @classmethod
    def from_wire(cls, data: Any) -> Member:
        what = "a fleet member"
        feeder = data.get("feeder") if isinstance(data, dict) else None
        if feeder is not None and not isinstance(feeder, str):
            raise WireError(f"{what}: field 'feeder' is {feeder!r:.40}")
        return cls(_field(data, "replica", str, what), _field(data, "address", str, what),
                   _field(data, "gen_ranks", int, what), _field(data, "incarnation", int, what), feeder,
                   _field(data, "layout", str, what))


@dataclass(frozen=True)
class Admission:
    """Train rank 0's answer to a join: the admitted :class:`Member` (its address to set up against, or its
    feeder, whose rank 0 writes the address under :func:`feed_key`), or why the join is refused (None: admitted)."""

    member: Member | None
    refused: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"member": None if self.member is None else self.member.to_wire(), "refused": self.refused}

    @classmethod
    def from_wire(cls, data: Any) -> Admission:
        refused = data.get("refused") if isinstance(data, dict) else None
        member = data.get("member") if isinstance(data, dict) else None
        if isinstance(refused, str) and member is None:
            return cls(None, refused)
        if refused is not None or member is None:
            raise WireError(f"a fleet admission: {data!r:.80}")
        return cls(Member.from_wire(member))


@dataclass(frozen=True)
class StepStart:
    """What the feeding side of a replica's job announces before each step moves a byte: the weights' version,
    the fleet's step and its members (a replica forwards the step to those it feeds, once it landed it)."""

    version: int
    step: int
    members: tuple[Member, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step, "members": [m.to_wire() for m in self.members]}

    @classmethod
    def from_wire(cls, data: Any) -> StepStart:
        what = "a fleet step's start"
        members = _field(data, "members", list, what)
        return cls(_field(data, "version", int, what), _field(data, "step", int, what),
                   tuple(Member.from_wire(m) for m in members))


@dataclass(frozen=True)
class FeedReport:
    """A feeder's rank 0 on one relayed replica's step: whether it landed, why not, and the fingerprint of the
    plan of their job ("" before its first setup)."""

    landed: bool
    reason: str = ""
    layout: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"landed": self.landed, "reason": self.reason[:2000], "layout": self.layout}

    @classmethod
    def from_wire(cls, data: Any) -> FeedReport:
        what = "a feeder's report"
        return cls(_field(data, "landed", bool, what), _field(data, "reason", str, what),
                   _field(data, "layout", str, what))


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the fleet sees it: its name, its ranks, the version it holds (None: none yet), when it
    joined (seconds since the epoch), its layout (the fingerprint of the plan its job runs; replicas with one
    layout share one plan; "" before its first step), the error of its last failed step (None: none) and the
    replica that feeds it (None: the trainers)."""

    replica: str
    gen_ranks: int
    version: int | None
    joined_at: float
    layout: str = ""
    last_error: str | None = None
    feeder: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"replica": self.replica, "gen_ranks": self.gen_ranks, "version": self.version,
                "joined_at": self.joined_at, "layout": self.layout, "last_error": self.last_error,
                "feeder": self.feeder}

    @classmethod
    def from_wire(cls, data: Any) -> ReplicaState:
        what = "a fleet state"
        version, error = data.get("version"), data.get("last_error")
        feeder = data.get("feeder")
        if (version is not None and type(version) is not int or error is not None and not isinstance(error, str)
                or feeder is not None and not isinstance(feeder, str)):
            raise WireError(f"{what}: {data!r:.80}")
        return cls(_field(data, "replica", str, what), _field(data, "gen_ranks", int, what), version,
                   float(_field(data, "joined_at", (int, float), what)), _field(data, "layout", str, what), error,
                   feeder)


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


class FleetStepError(RefitError):
    """A fleet step that lost a replica, under ``FleetOptions(membership="strict")``: raised on every train rank
    after the step; :attr:`result` says which replicas hold the version and which failed."""

    def __init__(self, result: FleetStep) -> None:
        failed = "; ".join(f"{f.replica}: {f.reason[:200]}" for f in result.failed)
        super().__init__(f"fleet step {result.step} (version {result.version}) lost {len(result.failed)} "
                         f"replica(s) under strict membership: {failed}; held by {list(result.landed)}")
        self.result = result


__all__ = ["JOINS", "LEADER", "REPLICA_NAME", "STATE", "Admission", "FeedReport", "FleetStep", "FleetStepError",
           "JoinRequest", "Member", "ReplicaFailure", "ReplicaState", "StepStart", "admit_key", "check_name",
           "feed_key", "join_key", "members_key", "outcome_key", "report_key", "start_key"]
