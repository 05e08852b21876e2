"""The train side of a fleet: :class:`RefitFleet`, one per train rank, for the whole run.

Each step, train rank 0 drops the replicas whose ranks left (died, or closed) or that failed the last step,
admits the joins whose replica has all its ranks asking (:class:`~refit_core.fleet.roster.Roster`), and
publishes the step's members; every train rank then sets up its part of each new replica's job (a
:class:`~refit_core.RefitSender` against the address train rank 0 gave it; replicas with one layout share one
plan) and sends the step to every member, one replica's job after the other. A replica's job fails alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.endpoints.sender import RefitSender
from refit_core.run.executor import StepStats
from refit_core.fleet.records import (
    JOINS,
    LEADER,
    STATE,
    FleetStep,
    JoinRequest,
    Member,
    ReplicaFailure,
    ReplicaState,
    admit_key,
    join_key,
    members_key,
    outcome_key,
    replica_identity,
    start_key,
)
from refit_core.fleet.roster import Roster
from refit_core.net.ports import free_port
from refit_core.net import wire
from refit_core.net.auth import JobCredentials
from refit_core.net.keys import RankId, size_key
from refit_core.net.store import StoreServer
from refit_core.net.rendezvous import Abandoned, Rendezvous
from refit_core.net.store_protocol import Endpoint
from refit_core.plan.planning import PlanCache

log = logging.getLogger("refit")

JOIN_READ_S = 1.0
"""How long train rank 0 waits for a join request whose ticket was drawn (its rank writes it right after)."""
LEFT = "its ranks left the job between steps (died, or closed): dropped until it joins again"
"""The last error of a replica dropped because its ranks left."""
LATE_TICKET_S = 600.0
"""How long train rank 0 keeps looking for the request of a drawn join ticket (its rank may have died)."""
KEPT_STEPS = 2
"""Steps whose member lists the fleet's store keeps (the other train ranks have read older ones)."""


class _ReplicaSender(RefitSender):
    """A train rank's part of one replica's job. Train rank 0 announces each step in the job's store before it
    moves a byte, and every other rank of the job, train or gen, waits for that without a deadline: the trainers
    reach the replicas one after another (train rank 0 last, when it waits for a replica that is stopped), and
    a replica idles between steps as long as training takes. Every rank's step deadline counts from the
    announcement (:class:`~refit_core.fleet.replica.ReplicaReceiver` on the replica's ranks). Train rank 0
    leaving ends the wait with an error."""

    def __init__(self, model: Any, *, member: Member, fleet_store: StoreServer | None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.member = member
        self._fleet_store = fleet_store
        """Train rank 0: the fleet's store, where a rank of the replica waits until its job's setup is done."""

    def _abandoned(self) -> Abandoned | None:
        """Train rank 0, during the job's setup: the ranks of the replica in neither its job's store nor the
        fleet's (a joining rank stays in the fleet's store until its job's setup is done) died after the fleet
        admitted it, before they came: the job's setup fails now, not at its deadline."""
        job = self._rdv.server if self._rdv is not None else None
        if job is None or self._fleet_store is None or self.settings is not None:  # set up: they came
            return None
        here = set(job.present()) | set(self._fleet_store.present())
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
                self._rdv.publish(key, version)
                if self._steps >= KEPT_STEPS:
                    self._rdv.client.delete_key(start_key(self._steps - KEPT_STEPS))
            else:
                self._rdv.wait([key], f"train rank 0 to start step {self._steps} of this replica's job",
                               timeout_s=math.inf, watched={LEADER})
        return super().send(version, only=only, reset=reset)


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
        self._senders: dict[str, tuple[Member, RefitSender]] = {}
        self._step = 0
        self._roster = Roster(options.store)
        self._states: dict[str, ReplicaState] = {}
        self._tickets = 0
        """Train rank 0: the last join ticket drawn that it knows of."""
        self._late: dict[int, float] = {}
        """Train rank 0: tickets drawn whose request it has yet to read, and since when (``time.monotonic()``)."""
        self.plans = PlanCache()
        """Train rank 0's plans, one per replica layout, shared by the replicas' jobs."""

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
        for name in set(self._senders) - {m.replica for m in members}:
            self._forget(name)
        joined, failed = self._set_up_new(members)
        landed = []
        for member in members:
            held = self._senders.get(member.replica)
            if held is None:  # its setup failed
                continue
            try:
                held[1].send(version)
            except RefitError as exc:
                self._forget(member.replica)
                failed.append(ReplicaFailure(member.replica, str(exc)))
                continue
            landed.append(member.replica)
        if self.leads:
            self._record(rdv, step, version, landed, failed)
        else:
            landed, failed = self._adopt(rdv, step)
        result = FleetStep(step, version, tuple(landed), tuple(joined), tuple(failed), time.perf_counter() - start)
        if failed:
            log.warning("refit fleet step %d: %d replica(s) failed and were dropped: %s", step, len(failed),
                        "; ".join(f"{f.replica}: {f.reason[:200]}" for f in failed))
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

    def _adopt(self, rdv: Rendezvous, step: int) -> tuple[list[str], list[ReplicaFailure]]:
        """Every other train rank: train rank 0's judgement of the step (its decisions rule: a replica that
        died after its vote failed there, whatever this rank saw); a replica it failed is dropped here too."""
        (outcome,) = rdv.wait([outcome_key(step)], f"train rank 0's outcome of fleet step {step}", timeout_s=math.inf,
                              watched={LEADER})  # train rank 0 bounds each replica's step by its deadline
        if not isinstance(outcome, dict) or not isinstance(outcome.get("landed"), list):
            raise RefitError(f"fleet step {step}: train rank 0's outcome is {outcome!r:.80}")
        failed = [ReplicaFailure(str(name), str(reason)) for name, reason in outcome.get("failed", [])]
        for failure in failed:
            self._forget(failure.replica)
        return [str(name) for name in outcome["landed"]], failed

    def _sender_for(self, member: Member) -> RefitSender:
        fleet_store = self._rdv.server if self._rdv is not None else None
        return _ReplicaSender(self.model, member=member, fleet_store=fleet_store, rendezvous=member.address,
                              rank=self.rank, world_size=self.world_size, options=self.options, plugins=self.plugins,
                              host_id=self.host_id, plan_cache=self.plans)

    def _forget(self, replica: str) -> None:
        held = self._senders.pop(replica, None)
        if held is not None:
            held[1].close()

    def _lead(self, rdv: Rendezvous, step: int) -> list[Member]:
        """Train rank 0: drop the replicas that left or failed, answer the joins, publish the step's members."""
        for member in list(self._roster.members.values()):
            if not self._alive(member):
                self._roster.drop(member.replica)
                self._forget(member.replica)
                if member.replica in self._states:
                    self._states[member.replica] = replace(self._states[member.replica], last_error=LEFT)
        answers = self._roster.consider(self._new_joins(rdv), self._alive, self._new_address, time.time())
        for old in answers.replaced:
            self._forget(old.replica)
        for member in answers.admitted:
            self._states[member.replica] = ReplicaState(member.replica, member.gen_ranks, None, time.time())
        members = list(self._roster.members.values())
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

    def _alive(self, member: Member) -> bool:
        """Whether every rank of ``member`` is still connected to its job (True before its first setup)."""
        held = self._senders.get(member.replica)
        if held is None or held[0] != member:
            return True
        connected = held[1].connected_gen_ranks()
        return connected is None or connected >= set(range(member.gen_ranks))

    def _new_address(self) -> str:
        host = Endpoint.parse(self.address).host
        return f"[{host}]:{free_port(host)}" if ":" in host else f"{host}:{free_port(host)}"

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

    def _record(self, rdv: Rendezvous, step: int, version: int, landed: list[str],
                failed: list[ReplicaFailure]) -> None:
        """Train rank 0: the step's outcome, for the other train ranks, and the fleet's view after it, kept and
        published for ``refit status``."""
        rdv.publish(outcome_key(step), {"landed": landed, "failed": [[f.replica, f.reason[:2000]] for f in failed]})
        if step >= KEPT_STEPS:
            rdv.client.delete_key(outcome_key(step - KEPT_STEPS))
        for name in landed:
            layout = self._senders[name][1].schedule
            state = self._states[name]
            self._states[name] = replace(state, version=version, last_error=None,
                                         layout=layout.fingerprint if layout is not None else state.layout)
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
