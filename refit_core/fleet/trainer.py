"""The train side of a fleet: :class:`RefitFleet`, one per train rank, for the whole run.

Each step, train rank 0 drops the replicas whose ranks left (died, or closed) or that failed the last step (with
the replicas below them in the relay tree), admits the joins whose replica has all its ranks asking
(:class:`~refit_core.fleet.roster.Roster`, which also picks each new replica's feeder), and publishes the step's
members; every train rank then sets up its part of the job of each new replica the trainers feed (a
:class:`~refit_core.fleet.jobs.JobSender` against the address train rank 0 gave it; replicas with one layout share
one plan) and sends the step to each, one replica's job after the other. Every other replica gets the step from
its feeder once the feeder landed it (:mod:`refit_core.fleet.mirror`), and train rank 0 reads the feeders'
reports. A replica's job fails alone, with the replicas below it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import RefitError
from refit_core.contract.options import Membership, RefitOptions, UpdateMode
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.fleet.jobs import KEPT_STEPS, JobSender
from refit_core.fleet.records import (
    JOINS,
    LEADER,
    STATE,
    FeedReport,
    FleetStep,
    FleetStepError,
    JoinRequest,
    Member,
    ReplicaFailure,
    ReplicaState,
    StepStart,
    admit_key,
    feed_key,
    join_key,
    members_key,
    outcome_key,
    replica_identity,
    report_key,
)
from refit_core.fleet.roster import Roster
from refit_core.net import wire
from refit_core.net.auth import JobCredentials
from refit_core.net.keys import size_key
from refit_core.net.ports import free_address
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.store import StoreServer
from refit_core.net.store_protocol import Endpoint
from refit_core.plan.planning import PlanCache

log = logging.getLogger("refit")

JOIN_READ_S = 1.0
"""How long train rank 0 waits for a join request whose ticket was drawn (its rank writes it right after)."""
LEFT = "its ranks left the job between steps (died, or closed): dropped until it joins again"
"""The last error of a replica dropped because its ranks left."""
LATE_TICKET_S = 600.0
"""How long train rank 0 keeps looking for the request of a drawn join ticket (its rank may have died)."""
FEED_S_PER_TIMEOUT = 2.0
"""How long train rank 0 waits for a feeder's report on each replica it feeds, in ``timeout_s``: a child's first
step sets its job up (within ``timeout_s``), then moves the step (within ``timeout_s``)."""


class RefitFleet:
    """The train side of a fleet of engine replicas that come and go; one per train rank, for the whole run.

    ``open()`` once (train rank 0 hosts the fleet's store at ``rendezvous``), then ``send(version)`` every step:
    it returns a :class:`~refit_core.fleet.records.FleetStep` saying which replicas hold ``version``, which
    joined for it and which failed it (each dropped until it joins again; the others are unaffected), and
    raises only when this train rank itself cannot go on. Replicas join with
    :func:`~refit_core.fleet.replica.join_fleet`. In place, every replica's job confirms each step (train rank
    0 decides, the other train ranks read it), so that every train rank judges each replica alike.
    """

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None) -> None:
        options = with_overrides(options or RefitOptions())
        if options.mode is UpdateMode.IN_PLACE and not options.confirm:
            options = options.overridden({"confirm": True}, explicit=False)
        self.model, self.address, self.rank, self.world_size = model, rendezvous, rank, world_size
        self.options, self.plugins, self.host_id = options, plugins, host_id
        self._rdv: Rendezvous | None = None
        self._senders: dict[str, tuple[Member, JobSender]] = {}
        self._step = 0
        self._roster = Roster(options.store, options.fleet)
        self._states: dict[str, ReplicaState] = {}
        self._tickets = 0
        """Train rank 0: the last join ticket drawn that it knows of."""
        self._late: dict[int, float] = {}
        """Train rank 0: tickets drawn whose request it has yet to read, and since when (``time.monotonic()``)."""
        self.plans = PlanCache()
        """Train rank 0's plans, one per replica layout, shared by the replicas' jobs."""
        self._admitted: set[str] = set()
        """Train rank 0: the replicas admitted for this step."""
        self._connections: dict[str, tuple[int | None, ...]] = {}
        """Train rank 0: the fleet's store's numbers of each member's ranks' connections when it was admitted."""

    @property
    def leads(self) -> bool:
        """True on train rank 0: it hosts the fleet's store and decides each step's members."""
        return self.rank == 0

    def open(self) -> None:
        """Join (train rank 0: host) the fleet's store. No replica needs to be there yet."""
        if self._rdv is not None:
            raise RefitError(f"train rank {self.rank}: the fleet is open already")
        credentials = JobCredentials.required(self.options, f"train rank {self.rank}")
        self._rdv = Rendezvous(self.address, host=self.leads, who=f"{Side.TRAIN.value}/{self.rank}",
                               timeout_s=self.options.timeout_s, credentials=credentials, limits=self.options.store,
                               guests=True)
        if self.leads:
            self._rdv.publish(size_key(Side.TRAIN), self.world_size)

    # -- one step ---------------------------------------------------------------------------------

    def send(self, version: int) -> FleetStep:
        """Send the model's weights as ``version`` to every replica of the fleet now (see the class doc)."""
        rdv = self._require_open()
        start = time.perf_counter()
        step, self._step = self._step, self._step + 1
        members = self._lead(rdv, step) if self.leads else self._follow(rdv, step)
        fed = [m for m in members if m.feeder is None]
        for name in set(self._senders) - {m.replica for m in fed}:
            self._forget(name)
        joined, failed = self._set_up_new(fed)
        announcement = StepStart(version, step, tuple(members))
        landed = []
        for member in fed:
            held = self._senders.get(member.replica)
            if held is None:  # its setup failed
                continue
            held[1].start = announcement
            try:
                held[1].send(version)
            except RefitError as exc:
                self._forget(member.replica)
                failed.append(ReplicaFailure(member.replica, str(exc)))
                continue
            landed.append(member.replica)
        if self.leads:
            layouts = self._await_feeds(rdv, step, members, landed, failed)
            joined += [m.replica for m in members if m.feeder is not None and m.replica in self._admitted
                       and m.replica in landed]
            self._record(rdv, step, version, landed, failed, joined, layouts)
        else:
            landed, failed, joined = self._adopt(rdv, step)
        result = FleetStep(step, version, tuple(landed), tuple(joined), tuple(failed), time.perf_counter() - start)
        if failed:
            log.warning("refit fleet step %d: %d replica(s) failed and were dropped: %s", step, len(failed),
                        "; ".join(f"{f.replica}: {f.reason[:200]}" for f in failed))
            if self.options.fleet.membership is Membership.STRICT:
                raise FleetStepError(result)
        return result

    def _set_up_new(self, members: list[Member]) -> tuple[list[str], list[ReplicaFailure]]:
        """Set up this rank's part of the job of every member new to it (a replica restarted under its name is
        new), before the step moves a byte to anyone; the replicas that joined, and those whose setup failed."""
        joined, failed = [], []
        for member in members:
            held = self._senders.get(member.replica)
            if held is not None and held[0] == member:
                continue
            self._forget(member.replica)
            sender = self._sender_for(member)
            try:
                sender.setup()
            except RefitError as exc:
                sender.close()
                failed.append(ReplicaFailure(member.replica, f"its setup failed: {exc}"))
                continue
            self._senders[member.replica] = (member, sender)
            joined.append(member.replica)
        return joined, failed

    def _await_feeds(self, rdv: Rendezvous, step: int, members: list[Member], landed: list[str],
                     failed: list[ReplicaFailure]) -> dict[str, str]:
        """Train rank 0: the outcome of every replica a feeder serves, in tree order, from its feeder's report
        (appended to ``landed`` and ``failed``). A replica whose feeder did not land the step fails with it; so
        does one whose feeder's rank 0 left, or reported nothing within :data:`FEED_S_PER_TIMEOUT` deadlines of
        its last report (a feeder serves its replicas one after the other), and every later one of that feeder.
        Returns each landed one's plan fingerprint."""
        layouts: dict[str, str] = {}
        gen_ranks = {m.replica: m.gen_ranks for m in members}
        since: dict[str, float] = {}
        stuck: dict[str, str] = {}
        for member in members:
            feeder = member.feeder
            if feeder is None:
                continue
            reason: str | None
            key = report_key(step, member)
            if feeder not in landed or feeder in stuck:
                reason = stuck.get(feeder) or f"its feeder {feeder} did not get the step"
                rdv.offer(feed_key(member.replica, member.incarnation), {"refused": reason})
            else:
                budget = self.options.timeout_s * FEED_S_PER_TIMEOUT
                watched = {replica_identity(feeder, r) for r in range(gen_ranks[feeder])}
                try:
                    (raw,) = rdv.wait([key], f"replica {feeder}'s report on feeding replica {member.replica} step "
                                      f"{step}", timeout_s=max(0.0, since.setdefault(feeder, time.monotonic())
                                                               + budget - time.monotonic()), watched=watched)
                    report = FeedReport.from_wire(raw)
                    reason = None if report.landed else report.reason
                    layouts[member.replica] = report.layout
                except RefitError as exc:
                    reason = stuck[feeder] = f"its feeder {feeder} did not report: {exc}"
                since[feeder] = time.monotonic()
            rdv.client.delete_key(key)
            if reason is None and member.replica in self._admitted:  # its ranks have read their job's address
                rdv.client.delete_key(feed_key(member.replica, member.incarnation))
            if reason is None:
                landed.append(member.replica)
            else:
                failed.append(ReplicaFailure(member.replica, reason))
        return layouts

    def _adopt(self, rdv: Rendezvous, step: int) -> tuple[list[str], list[ReplicaFailure], list[str]]:
        """Every other train rank: train rank 0's judgement of the step (its decisions rule: a replica that
        died after its vote failed there, whatever this rank saw); a replica it failed is dropped here too."""
        (outcome,) = rdv.wait([outcome_key(step)], f"train rank 0's outcome of fleet step {step}", timeout_s=math.inf,
                              watched={LEADER})  # train rank 0 bounds each replica's step by its deadline
        if not isinstance(outcome, dict) or not isinstance(outcome.get("landed"), list):
            raise RefitError(f"fleet step {step}: train rank 0's outcome is {outcome!r:.80}")
        failed = [ReplicaFailure(str(name), str(reason)) for name, reason in outcome.get("failed", [])]
        for failure in failed:
            self._forget(failure.replica)
        return ([str(name) for name in outcome["landed"]], failed,
                [str(name) for name in outcome.get("joined", [])])

    def _sender_for(self, member: Member) -> JobSender:
        fleet_store = self._rdv.server if self._rdv is not None else None
        return JobSender(self.model, member=member, fleet_present=None if fleet_store is None else fleet_store.present,
                         rendezvous=member.address, rank=self.rank, world_size=self.world_size, options=self.options,
                         plugins=self.plugins, host_id=self.host_id, plan_cache=self.plans)

    def _forget(self, replica: str) -> None:
        held = self._senders.pop(replica, None)
        if held is not None:
            held[1].close()

    def _lead(self, rdv: Rendezvous, step: int) -> list[Member]:
        """Train rank 0: drop the replicas that left or failed (with the replicas below them), answer the joins,
        publish the step's members."""
        connected = self._fleet_store().connections()

        def alive(member: Member) -> bool:
            return self._alive(member, connected)

        for member in list(self._roster.members.values()):
            if member.replica in self._roster.members and not alive(member):
                for dropped in self._roster.drop(member.replica):
                    self._forget(dropped.replica)
                    error = LEFT if dropped is member else f"its feeder {dropped.feeder} was dropped: {LEFT}"
                    self._states[dropped.replica] = replace(self._states[dropped.replica], last_error=error)
        answers = self._roster.consider(self._new_joins(rdv), alive, self._new_address, time.time())
        for old in answers.replaced:
            self._forget(old.replica)
        self._admitted = {m.replica for m in answers.admitted}
        connections = self._fleet_store().connections()  # again: a joiner may have connected since the first read
        for member in answers.admitted:
            self._connections[member.replica] = self._connections_of(member, connections)
            self._states[member.replica] = ReplicaState(member.replica, member.gen_ranks, None, time.time(),
                                                        feeder=member.feeder)
        members = list(self._roster.members.values())
        self._connections = {m.replica: self._connections[m.replica] for m in members}
        rdv.publish(members_key(step), [m.to_wire() for m in members])
        for ticket, admission in answers.admissions.items():
            rdv.publish(admit_key(ticket), admission.to_wire())
        if step >= KEPT_STEPS:
            rdv.client.delete_key(members_key(step - KEPT_STEPS))
        return members

    def _follow(self, rdv: Rendezvous, step: int) -> list[Member]:
        """Every other train rank: the step's members as train rank 0 published them."""
        (listed,) = rdv.wait([members_key(step)], f"train rank 0's member list of fleet step {step}",
                             watched={LEADER})
        if not isinstance(listed, list):
            raise RefitError(f"fleet step {step}: train rank 0's member list is {listed!r:.80}")
        return [Member.from_wire(m) for m in listed]

    def _fleet_store(self) -> StoreServer:
        assert self._rdv is not None and self._rdv.server is not None, "train rank 0 hosts the fleet's store"
        return self._rdv.server

    @staticmethod
    def _connections_of(member: Member, connections: dict[str, int]) -> tuple[int | None, ...]:
        """The numbers of the connections of ``member``'s ranks to the fleet's store (None: not connected)."""
        return tuple(connections.get(replica_identity(member.replica, r)) for r in range(member.gen_ranks))

    def _alive(self, member: Member, connections: dict[str, int]) -> bool:
        """Whether every rank of ``member`` is still connected: to the fleet's store (``connections``: its
        connection numbers now), over the connection it was admitted on (a rank restarted under its name comes back
        on another), and to its job with the trainers (True before its first setup)."""
        if self._connections_of(member, connections) != self._connections.get(member.replica):
            return False
        held = self._senders.get(member.replica)
        if held is None or held[0] != member:
            return True
        connected = held[1].connected_gen_ranks()
        return connected is None or connected >= set(range(member.gen_ranks))

    def _new_address(self) -> str:
        return free_address(Endpoint.parse(self.address).host)

    def _new_joins(self, rdv: Rendezvous) -> list[JoinRequest]:
        """The join requests written since the last step. A ticket drawn but not yet written waits for its request
        (a joining rank writes it right after drawing it), up to :data:`JOIN_READ_S` once, then in later steps
        for :data:`LATE_TICKET_S`: one whose rank died in between holds up no other join."""
        drawn = rdv.read(JOINS, default=0)
        now = time.monotonic()
        for ticket in range(self._tickets + 1, (drawn if type(drawn) is int else 0) + 1):
            self._late[ticket] = now
            self._tickets = ticket
        requests = []
        waited = False
        for ticket, since in list(self._late.items()):
            raw = rdv.client.try_get(join_key(ticket), wait_s=0.0 if waited or since < now else JOIN_READ_S)
            waited = waited or since == now
            if raw is None:
                if now - since > LATE_TICKET_S:
                    del self._late[ticket]
                continue
            del self._late[ticket]
            rdv.client.delete_key(join_key(ticket))
            try:
                requests.append(JoinRequest.from_wire(ticket, wire.decode(bytes(raw), join_key(ticket))))
            except (RefitError, ValueError) as exc:
                log.warning("refit fleet: ignored join ticket %d: %s", ticket, exc)
        return requests

    def _record(self, rdv: Rendezvous, step: int, version: int, landed: list[str], failed: list[ReplicaFailure],
                joined: list[str], layouts: dict[str, str]) -> None:
        """Train rank 0: the step's outcome, for the other train ranks, and the fleet's view after it, kept and
        published for ``refit status`` (``layouts``: the plan fingerprints of the replicas feeders serve)."""
        rdv.publish(outcome_key(step), {"landed": landed, "joined": joined,
                                        "failed": [[f.replica, f.reason[:2000]] for f in failed]})
        if step >= KEPT_STEPS:
            rdv.client.delete_key(outcome_key(step - KEPT_STEPS))
        for name in landed:
            held = self._senders.get(name)
            schedule = held[1].schedule if held is not None else None
            state = self._states[name]
            layout = schedule.fingerprint if schedule is not None else layouts.get(name) or state.layout
            self._states[name] = replace(state, version=version, last_error=None, layout=layout)
        for failure in failed:
            self._roster.drop(failure.replica)
            if failure.replica in self._states:
                self._states[failure.replica] = replace(self._states[failure.replica], last_error=failure.reason[:1000])
        rdv.publish(STATE, [s.to_wire() for s in self._states.values()])

    # -- views and lifetime -------------------------------------------------------------------------

    def fleet(self) -> tuple[ReplicaState, ...]:
        """Train rank 0: every replica the fleet knows (those that failed their last step too, with its error),
        in the order they joined. Other train ranks: the view train rank 0 last published."""
        if self.leads:
            return tuple(self._states.values())
        wire = self._require_open().read(STATE, default=[])
        return tuple(ReplicaState.from_wire(s) for s in wire) if isinstance(wire, list) else ()

    def close(self) -> None:
        """Close every replica's job and leave (train rank 0: stop) the fleet's store."""
        for name in list(self._senders):
            self._forget(name)
        rdv, self._rdv = self._rdv, None
        if rdv is not None:
            rdv.close()

    def _require_open(self) -> Rendezvous:
        if self._rdv is None:
            raise RefitError(f"train rank {self.rank}: call open() on the fleet before send()")
        return self._rdv

    def __enter__(self) -> RefitFleet:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RefitFleet"]
