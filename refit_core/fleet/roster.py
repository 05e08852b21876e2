"""Train rank 0's roster of a fleet: which replicas are in, and the answer to each join (pure bookkeeping, no
store: :mod:`refit_core.fleet.trainer` reads the joins and publishes the answers)."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from refit_core.contract.options import FleetOptions, StoreLimits
from refit_core.fleet.records import Admission, JoinRequest, Member

MINUTE_S = 60.0


@dataclass(frozen=True)
class Answers:
    """What one round of joins came to: each answered ticket's :class:`Admission`, the replicas admitted, and
    the members they replace (the same name, restarted: the trainers drop the old job), with the replicas below
    those in the relay tree."""

    admissions: dict[int, Admission]
    admitted: tuple[Member, ...] = ()
    replaced: tuple[Member, ...] = ()


@dataclass
class Roster:
    """The fleet's members in the order they joined (a feeder before the replicas it feeds), and the joins still
    waiting for the rest of their replica's ranks. ``limits``: the fleet's size and join rate
    (:class:`StoreLimits`); ``shape``: how many replicas the trainers feed and how many each feeder forwards to
    (:class:`FleetOptions`)."""

    limits: StoreLimits = field(default_factory=StoreLimits)
    shape: FleetOptions = field(default_factory=FleetOptions)
    members: dict[str, Member] = field(default_factory=dict)
    pending: dict[str, dict[int, JoinRequest]] = field(default_factory=dict)
    admitted_at: deque[float] = field(default_factory=deque)

    def drop(self, replica: str) -> tuple[Member, ...]:
        """Take ``replica`` out of the fleet (it died, left or failed a step), and every replica below it in the
        relay tree (they lost their feed); their member records, ``replica``'s first (none if absent)."""
        member = self.members.pop(replica, None)
        if member is None:
            return ()
        below = [m.replica for m in self.members.values() if m.feeder == replica]
        return (member, *(d for name in below for d in self.drop(name)))

    def depth(self, replica: str) -> int:
        """Feeders between ``replica`` and the trainers (0: the trainers feed it)."""
        feeder = self.members[replica].feeder
        return 0 if feeder is None else 1 + self.depth(feeder)

    def _feeder(self, layout: str) -> str | None:
        """Who feeds a new replica of ``layout``: None (the trainers) while they feed fewer than
        ``shape.direct`` (or all, at 0), or when it cannot be fed by another; else the shallowest member of its
        layout with room for another child (None if none has)."""
        fed = [m for m in self.members.values() if m.feeder is None]
        if not layout or not self.shape.direct or len(fed) < self.shape.direct:
            return None
        children: dict[str, int] = {}
        for m in self.members.values():
            if m.feeder is not None:
                children[m.feeder] = children.get(m.feeder, 0) + 1
        room = [m.replica for m in self.members.values()
                if m.layout == layout and children.get(m.replica, 0) < self.shape.fanout]
        return min(room, key=self.depth) if room else None

    def consider(self, requests: Iterable[JoinRequest], alive: Callable[[Member], bool], address: Callable[[], str],
                 now: float) -> Answers:
        """Answer the joins whose replica has all its ranks asking; the others wait for theirs. ``alive``: whether
        a member's ranks are still connected (a name in use by a live member is refused; by a dead one, the
        new replica replaces it); ``address``: a new job's address for an admitted replica; ``now``: the time."""
        answers: dict[int, Admission] = {}
        for request in requests:
            waiting = self.pending.setdefault(request.replica, {})
            earlier = waiting.get(request.rank)
            if earlier is not None:
                answers[earlier.ticket] = Admission(None, f"replica {request.replica} rank {request.rank} asked again "
                                                          f"(ticket {request.ticket}); this join is superseded")
            waiting[request.rank] = request
        admitted: list[Member] = []
        replaced: list[Member] = []
        for replica, waiting in list(self.pending.items()):
            sizes = {r.gen_ranks for r in waiting.values()}
            refusal: str | None
            if len(sizes) > 1:
                refusal = f"replica {replica}'s ranks disagree on its size ({sorted(sizes)} ranks)"
            elif set(waiting) != set(range(sizes.pop())):
                continue  # its other ranks have yet to ask
            else:
                refusal = self._refusal(replica, alive, now)
            del self.pending[replica]
            if refusal is not None:
                answers.update({r.ticket: Admission(None, refusal) for r in waiting.values()})
                continue
            replaced.extend(self.drop(replica))
            layout = replica_layout([waiting[r].layout for r in range(len(waiting))])
            feeder = self._feeder(layout)
            member = Member(replica, address() if feeder is None else "", len(waiting), waiting[0].ticket, feeder,
                            layout)
            self.members[replica] = member
            self.admitted_at.append(now)
            admitted.append(member)
            answers.update({r.ticket: Admission(member) for r in waiting.values()})
        return Answers(answers, tuple(admitted), tuple(replaced))

    def _refusal(self, replica: str, alive: Callable[[Member], bool], now: float) -> str | None:
        """Why replica ``replica``, all its ranks asking, may not join now (None: it may)."""
        current = self.members.get(replica)
        if current is not None and alive(current):
            return (f"replica {replica} is already in the fleet, its ranks connected: a replica identity already "
                    "present is refused (give each replica its own name, or stop the old one first)")
        while self.admitted_at and self.admitted_at[0] <= now - MINUTE_S:
            self.admitted_at.popleft()
        if len(self.admitted_at) >= self.limits.max_joins_per_minute:
            return (f"the fleet admitted {len(self.admitted_at)} replicas in the last minute, the limit "
                    f"(StoreLimits.max_joins_per_minute on train rank 0); join again later")
        if current is None and len(self.members) >= self.limits.max_replicas:
            return (f"the fleet holds {len(self.members)} replicas, the limit (StoreLimits.max_replicas on train "
                    "rank 0)")
        return None


def replica_layout(ranks: list[str]) -> str:
    """A replica's layout from its ranks' digests, in rank order ("" if one rank's engine cannot feed)."""
    if not all(ranks):
        return ""
    return hashlib.sha256("|".join(ranks).encode()).hexdigest()[:16]


__all__ = ["Answers", "Roster", "replica_layout"]
