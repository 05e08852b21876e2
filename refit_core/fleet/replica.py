"""The gen side of a fleet: :func:`join_fleet`, every rank of a replica, to join the running job (or join it
again after a crash or a failed step); :class:`ReplicaReceiver`, which receives each step and forwards it to the
replicas it feeds."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.fleet.mirror import MirrorSender, layout_digest
from refit_core.fleet.records import (
    JOINS,
    LEADER,
    Admission,
    FeedReport,
    JoinRequest,
    Member,
    StepStart,
    admit_key,
    check_name,
    feed_key,
    join_key,
    replica_identity,
    report_key,
    start_key,
)
from refit_core.net.auth import JobCredentials
from refit_core.net.ports import free_address
from refit_core.net.rendezvous import Rendezvous
from refit_core.plan.planning import PlanCache
from refit_core.run.executor import StepStats

log = logging.getLogger("refit")

JOIN_TIMEOUT_S = 600.0
"""How long a joining rank waits, by default, for the trainers' next step to admit its replica."""


class ReplicaReceiver(RefitReceiver):
    """A rank of a fleet's replica: ``receive()`` first waits, without a deadline, until the feeding side (the
    trainers, or the replica's feeder) announces the step in the replica's job (a replica idles between steps as
    long as training takes, and the feeders reach their replicas one after another); the step's deadline counts
    from then. The feeding side's rank 0 leaving, or dropping this replica (its job's store closes), ends the
    wait with an error. Once the step landed, ``receive()`` returns, and a thread forwards the step to the replicas
    this one feeds (one job each, through a :class:`~refit_core.fleet.mirror.MirrorSender`; it only reads the
    engine's weights), rank 0 reporting each one's outcome to the fleet; a child that fails costs this replica
    nothing. The next ``receive()`` (and ``close()``) first waits for that forwarding to end
    (:meth:`wait_forwarded`).

    ``fleet``: this rank's connection to the fleet's store, kept while it serves (closed by ``close()``);
    ``member``: the replica as the fleet admitted it.
    """

    def __init__(self, model: Any, *, fleet: Rendezvous, member: Member, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.fleet_store = fleet
        self.member = member
        if member.feeder is not None:
            self.store_host = f"replica {member.feeder} rank 0 (its feeder)"
        self.start: StepStart | None = None
        """The last step's announcement (None before the first)."""
        self._feeding: dict[str, MirrorSender] = {}
        self._plans = PlanCache()
        self._forwarding: threading.Thread | None = None

    def receive(self, *, only: Iterable[str] | None = None) -> StepStats:
        self.wait_forwarded()
        if self.settings is not None and self._rdv is not None and self._broken is None:
            try:
                (announced,) = self._rdv.wait([start_key(self._steps)], f"the feeding side to start step "
                                              f"{self._steps}", timeout_s=math.inf, watched={LEADER})
            except RefitError as exc:
                self._failed(None if self.start is None else self.start.step + 1,
                             f"its feeder {self.member.feeder} stopped answering: {exc}")
                raise
            self.start = StepStart.from_wire(announced)
        try:
            stats = super().receive(only=only)
        except RefitError as exc:
            self._failed(None if self.start is None else self.start.step, str(exc))
            raise
        except BaseException:
            self._stop_feeding()
            raise
        start = self.start
        if start is not None and (self._feeding or any(m.feeder == self.member.replica for m in start.members)):
            self._forwarding = threading.Thread(target=self._feed, args=(start, stats.version), daemon=True,
                                                name=f"refit-forward-{self.member.replica}-{self.rank}")
            self._forwarding.start()
        return stats

    def wait_forwarded(self) -> None:
        """Return once the last step's forwarding to the replicas this one feeds ended (each child's step is
        bounded by its deadline); at once if there is none."""
        thread, self._forwarding = self._forwarding, None
        if thread is not None:
            thread.join()

    def _feed(self, start: StepStart, version: int) -> None:
        """Forward ``version`` to every replica this one feeds in ``start``'s members, one after the other; rank
        0 reports each outcome to the fleet (a child's failure stays the child's). Runs on the forwarding
        thread: nothing it meets may leave it."""
        try:
            self._feed_each(start, version)
        except BaseException as exc:  # noqa: BLE001 - a thread's error would only be printed
            log.error("refit fleet: replica %s rank %d stopped forwarding step %d: %r", self.member.replica,
                      self.rank, start.step, exc)

    def _feed_each(self, start: StepStart, version: int) -> None:
        me = self.member.replica
        children = [m for m in start.members if m.feeder == me]
        self._stop_feeding(set(self._feeding) - {c.replica for c in children})
        for child in children:
            mirror = self._feeding.get(child.replica)
            if mirror is not None and mirror.member != child:  # restarted under its name: a new job
                self._stop_feeding([child.replica])
                mirror = None
            try:
                if mirror is None:
                    mirror = self._mirror_for(child)
                    self._feeding[child.replica] = mirror
                mirror.start = start
                mirror.send(version)
                assert mirror.schedule is not None
                report = FeedReport(True, layout=mirror.schedule.fingerprint)
            except RefitError as exc:
                self._stop_feeding([child.replica])
                report = FeedReport(False, f"its feeder {me} could not forward the step: {exc}")
            if self.rank == 0:
                try:
                    self.fleet_store.publish(report_key(start.step, child), report.to_wire())
                except RefitError as exc:
                    log.warning("refit fleet: replica %s could not report on %s: %s", me, child.replica, exc)

    def _mirror_for(self, child: Member) -> MirrorSender:
        """Set up this rank's part of the job that feeds ``child``: rank 0 hosts its store on the interface that
        reaches the fleet's and writes the address to the fleet's store, where the child's ranks read it."""
        me, fleet = self.member.replica, self.fleet_store
        key = feed_key(child.replica, child.incarnation)
        if self.rank == 0:
            address = free_address(fleet.client.local_host)
            fleet.publish(key, {"address": address})
        else:
            (feed,) = fleet.wait([key], f"replica {me} rank 0's address for feeding replica {child.replica}",
                                 watched={replica_identity(me, 0)})
            address = _address_of(feed, child.replica)
        assert self.settings is not None
        mirror = MirrorSender(self, replica=me, member=child, rendezvous=address, options=self.settings,
                              fleet_present=fleet.client.present if self.rank == 0 else None, plans=self._plans)
        try:
            mirror.setup()
        except BaseException:
            mirror.close()
            raise
        return mirror

    def _failed(self, step: int | None, reason: str) -> None:
        """This replica failed fleet step ``step`` (None: unknown): the replicas it feeds lose their feed now, not
        at their deadline, and if a feeder serves it, rank 0 says so where train rank 0 waits for the feeder's
        report (a feeder that died or stopped reports nothing; a report already there stays)."""
        self._stop_feeding()
        if self.rank == 0 and self.member.feeder is not None and step is not None:
            self.fleet_store.offer(report_key(step, self.member), FeedReport(False, reason).to_wire())

    def _stop_feeding(self, children: Iterable[str] | None = None) -> None:
        """Close the jobs that feed ``children`` (None: every replica this one feeds)."""
        for name in list(self._feeding if children is None else children):
            held = self._feeding.pop(name, None)
            if held is not None:
                held.close()

    def close(self) -> None:
        """Close the jobs feeding this replica's children (once the forwarding under way ended), its own job, and
        leave the fleet's store."""
        self.wait_forwarded()
        self._stop_feeding()
        super().close()
        self.fleet_store.close()


def _address_of(feed: Any, replica: str) -> str:
    """The address in a :func:`feed_key` value; a refusal (the feeder lost the step) raises, naming why."""
    if isinstance(feed, dict) and isinstance(feed.get("address"), str):
        return str(feed["address"])
    reason = feed.get("refused") if isinstance(feed, dict) else None
    raise RefitError(f"replica {replica} cannot get its first step: {reason or f'bad feed record {feed!r:.80}'}; "
                     "join again")


def join_fleet(engine: Any, *, fleet: str, replica: str, rank: int, world_size: int,
               options: RefitOptions | None = None, plugins: PluginManager | None = None, host_id: str | None = None,
               join_timeout_s: float = JOIN_TIMEOUT_S) -> ReplicaReceiver:
    """Join rank ``rank`` of replica ``replica`` (``world_size`` ranks) to the fleet whose store is at ``fleet``.

    Returns this rank's :class:`ReplicaReceiver` (a :class:`~refit_core.RefitReceiver`), set up: its next
    ``receive()`` is the step that admitted the replica, whole, and waits for the feeding side to start each step.
    Train rank 0 admits a replica at the start of a step once all its ranks asked, so this waits up to
    ``join_timeout_s`` for that. The trainers feed the replica, or (``FleetOptions.direct`` on train rank 0) a
    replica of its layout that holds the weights does; then this also waits for that replica to land the step
    (one that does not makes this raise :class:`~refit_core.RefitError` saying so: join again).
    Every rank proves the job's secret (``options.secret``). A replica named like one still in the fleet, its
    ranks connected, is refused by name (:class:`~refit_core.RefitError`); one whose ranks died or closed is
    replaced (a restart). After a failed step (``receive()`` raised), ``close()`` the receiver and join again.
    """
    check_name(replica)
    if not 0 <= rank < world_size:
        raise RefitError(f"replica {replica}: rank {rank} of a world of {world_size}")
    options = with_overrides(options or RefitOptions())
    plugins = plugins or get_plugin_manager()
    layout = layout_digest(plugins.destination_map(engine))
    credentials = JobCredentials.required(options, f"replica {replica} rank {rank}")
    rdv = Rendezvous(fleet, host=False, who=replica_identity(replica, rank), timeout_s=options.timeout_s,
                     credentials=credentials)
    try:  # connected to the fleet's store while it serves: train rank 0 sees a death at once
        ticket = rdv.client.add(JOINS, 1)
        rdv.publish(join_key(ticket), JoinRequest(replica, rank, world_size, ticket, layout).to_wire())
        deadline = time.monotonic() + join_timeout_s
        (answer,) = rdv.wait([admit_key(ticket)], f"the fleet to admit replica {replica} (the trainers' next step)",
                             timeout_s=max(0.0, deadline - time.monotonic()), watched={LEADER})
        admission = Admission.from_wire(answer)
        rdv.client.delete_key(admit_key(ticket))
        member = admission.member
        if member is None:
            raise RefitError(f"the fleet at {fleet} refused replica {replica} rank {rank}: {admission.refused}")
        address = member.address
        if member.feeder is not None:
            (feed,) = rdv.wait([feed_key(replica, member.incarnation)],
                               f"replica {member.feeder} (its feeder) to land the step and serve replica {replica}",
                               timeout_s=max(0.0, deadline - time.monotonic()),
                               watched={LEADER, replica_identity(member.feeder, 0)})
            address = _address_of(feed, replica)
        receiver = ReplicaReceiver(engine, fleet=rdv, member=member, rendezvous=address, rank=rank,
                                   world_size=world_size, options=options, plugins=plugins, host_id=host_id)
        receiver.setup()
    except BaseException:
        rdv.close()
        raise
    return receiver


__all__ = ["JOIN_TIMEOUT_S", "ReplicaReceiver", "join_fleet"]
