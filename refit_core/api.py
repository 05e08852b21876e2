"""The public API: a :class:`RefitSender` on every train rank, a :class:`RefitReceiver` on every gen rank.

Both sides call ``setup()`` once (metadata exchange through the rendezvous store, planning once on
train rank 0, which publishes every other rank its own part of the plan, agreement on the plan's
fingerprint, transport creation), then every step the train side calls ``send(version)`` and the gen
side ``receive()``. The two sides are separate programs; train rank 0 hosts the rendezvous store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.env import with_overrides
from refit_core.contract.errors import PlanError, RefitError, TransferError
from refit_core.contract.experts import ExpertNaming, group_meta, group_piece, group_side
from refit_core.contract.failures import StepFailedError, StepFailure
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.pieces import DestinationPiece, Piece, PieceMeta
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.spec import TensorSpec
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.transport import Transport, open_transport
from refit_core.plan import codec as wire  # plan/codec.py, the metadata codec, under net/wire's old name
from refit_core.plan import rankplan
from refit_core.plan.gcpause import gc_paused
from refit_core.plan.items import Message
from refit_core.plan.links import Link, Placement, pair_links, placement_of
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.relay import RelayPlan, check_relay_pairs
from refit_core.plan.schedule import Schedule
from refit_core.run.colocated import ColocatedReceiver, ColocatedSender, by_peer, split_rounds
from refit_core.run.copies import CopyCounts
from refit_core.run.executor import ForwardExecutor, ReceiveExecutor, SendExecutor, StepStats
from refit_core.run.quant.receiver import ReceiverQuantizer
from refit_core.run.timing import SetupTimes, StepTrace
from refit_core.run.validate import check_no_overlap, check_view
from refit_core.units import format_bytes

log = logging.getLogger("refit")


def _device_of(pieces: list[Piece]) -> torch.device:
    devices = {p.view.device for p in pieces if p.view is not None}
    if len(devices) > 1:
        raise RefitError(f"pieces live on several devices {sorted(map(str, devices))}; one device per rank")
    return devices.pop() if devices else torch.device("cpu")


class _Endpoint:
    """What both sides share: setup (metadata exchange, agreement, planning, transport) and teardown.

    ``options`` are this rank's wishes, with the environment's overrides applied
    (:mod:`refit_core.contract.env`); ``settings`` are the options every rank agreed on at setup (the train
    side's rank 0's), None before setup.
    """

    side: str

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None) -> None:
        """``host_id`` names the memory this rank can share with others (default: this machine);
        ranks with different ids never read each other's memory (tests split one machine with it)."""
        if not 0 <= rank < world_size:
            raise RefitError(f"{self.side} rank {rank} is outside world_size {world_size}")
        self.model = model
        self.address = rendezvous
        self.rank = rank
        self.world_size = world_size
        self.options = with_overrides(options or RefitOptions())
        self.plugins = plugins or get_plugin_manager()
        self.settings: RefitOptions | None = None
        self.schedule: Schedule | None = None
        self.transport: Transport | None = None
        self.device = torch.device("cpu")
        self.sizes: dict[str, int] = {}
        self._rdv: Rendezvous | None = None
        self._pieces: list[Piece] = []
        self._counts: dict[str, int] = {}
        self._experts: ExpertNaming = self.plugins.expert_naming()
        self._executor: SendExecutor | ReceiveExecutor | None = None
        self.host_id = host_id
        self.links: dict[tuple[int, int], Link] = {}
        """The links of this rank's pairs after setup (the planner, train rank 0: every pair's), see
        :mod:`refit_core.plan.links`."""
        self._network = False  # whether the network transport opens: the planner's answer
        self._colocated: ColocatedSender | ColocatedReceiver | None = None
        self._colocated_bound = False
        self._bound_names: list[str] = []
        self._steps = 0  # steps since setup (landing keys of staged mode)
        self._broken: str | None = None  # why the last step failed; a new setup() clears it
        self.relay: RelayPlan | None = None
        """The relay fanout plan agreed at setup (None without relay), see :mod:`refit_core.plan.relay`."""
        self._relay_out: SendExecutor | ForwardExecutor | None = None
        """A gen rank's forwarding once its step landed: to the next wave's replicas, or within its node."""
        self._phases: dict[str, float] = {}
        self._bind_s: float | None = None
        self._downloaded = 0

    # -- setup --------------------------------------------------------------------------------

    def _local_pieces(self) -> list[Piece]:
        raise NotImplementedError

    def setup(self) -> Schedule:
        """Exchange metadata, plan, check agreement and open the transport. Collective over both sides.

        Train rank 0 plans once and publishes each rank its own part (:mod:`refit_core.plan.rankplan`):
        the returned :class:`Schedule` holds the whole plan there, and this rank's own messages
        elsewhere (fingerprint and summary are the whole plan's everywhere). Every wait has the deadline
        ``options.timeout_s``; a failure on any rank (including while the transport opens) reaches
        every other rank at once. After a failed setup or step, calling ``setup()`` again (same
        address) starts over: it closes what is left first.
        """
        start = time.perf_counter()
        if self._rdv is not None or self.transport is not None:
            self.close()
        credentials = JobCredentials.of(self.options.job, self.options.secret)
        self._rdv = Rendezvous(self.address, host=self._hosts_store, who=f"{self.side}/{self.rank}",
                               timeout_s=self.options.timeout_s, credentials=credentials)
        self.sizes = {}
        self._phases, self._bind_s = {}, None
        try:
            began = time.perf_counter()
            pieces = self._local_pieces()
            for p in pieces:  # a gen rank's views may be placeholders until its first bind
                if p.view is not None:
                    check_view(p.spec, p.box, p.view, destination=False, placeholder=self.side == GEN)
            self.device = _device_of(pieces)
            self._phases["pieces"] = time.perf_counter() - began
            began = time.perf_counter()
            settings, metas = self._exchange_metadata(pieces)
            self._phases["metadata"] = time.perf_counter() - began
            schedule = self._plan(settings, pieces, metas)  # records "plan" and "agree"
            began = time.perf_counter()
            if self._network:  # the planner's answer, the same on every rank (relay always uses it)
                self.transport = self._open_transport(settings)
            self._phases["transport"] = time.perf_counter() - began
            self._downloaded = self._require_rendezvous().downloaded
        except Exception as exc:
            self._abort_setup(exc)
            raise
        self.settings = settings
        self.schedule = schedule
        self._broken = None
        self._steps = 0
        self._bound = False  # new executors: bind the views again
        self._colocated_bound = False
        self._rdv.seal()
        self._make_executors(schedule, settings)
        self._pieces = pieces
        summary = schedule.summary
        log.info("refit %s rank %d ready in %.2f s: %s in %d messages over %d rounds, plan %s",
                 self.side, self.rank, time.perf_counter() - start, format_bytes(summary.bytes),
                 summary.messages, summary.rounds, schedule.fingerprint)
        return schedule

    @property
    def setup_times(self) -> SetupTimes | None:
        """Where the last ``setup()`` went (None before one succeeded); ``bind_s`` is None until the
        views were bound (gen ranks bind at their first step)."""
        p = self._phases
        if "transport" not in p:
            return None
        return SetupTimes(p["pieces"], p["metadata"], p["plan"], p["agree"], p["transport"], self._bind_s,
                          self._downloaded, self.plans)

    def _open_transport(self, settings: RefitOptions) -> Transport:
        """Open the transport (every rank passed the agreement barrier: all are ready to); a failure
        on any rank stops them all."""
        rdv = self._require_rendezvous()
        try:
            return open_transport(settings.transport, rdv.store, self._global_rank(), sum(self.sizes.values()),
                                  self.device, settings.timeout_s, settings.nccl)
        except RefitError:
            raise
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise RefitError(f"the {settings.transport.value} transport did not open: {exc}") from exc

    @property
    def _hosts_store(self) -> bool:
        return self.side == TRAIN and self.rank == 0

    @property
    def plans(self) -> bool:
        """Whether this rank is the planner (train rank 0, the store's host): it alone reads every
        rank's metadata and plans; every other rank reads only its own part of the plan."""
        return self._hosts_store

    def _exchange_metadata(self, pieces: list[Piece]) -> tuple[RefitOptions, dict[str, list[list[PieceMeta]]] | None]:
        """Publish this rank's piece metadata and placement; return the agreed settings and, on the
        planner only, every rank's metadata.

        The train side's rank 0 publishes its resolved options; every rank adopts them or, where it
        set a setting explicitly to another value, fails with a :class:`PlanError` naming it.
        """
        rdv = self._require_rendezvous()
        if self.rank == 0:
            rdv.publish(f"size/{self.side}", self.world_size)
        if self._hosts_store:
            rdv.publish("options", self.options.resolved(self.device.type).to_wire())
        (published,) = rdv.wait(["options"], "the train side's options")
        settings = self.options.agree_with(RefitOptions.from_wire(published), f"{self.side} rank {self.rank}")
        rdv.publish(f"meta/{self.side}/{self.rank}", wire.metas_to_wire([p.meta for p in pieces]))
        rdv.publish(f"placement/{self.side}/{self.rank}", placement_of(self.device, self.host_id).encode())
        sizes = rdv.wait(["size/train", "size/gen"], "both sides' sizes")
        if not all(type(n) is int and 0 < n <= 1 << 20 for n in sizes):
            raise RefitError(f"the rendezvous holds invalid world sizes {sizes!r:.80}")
        self.sizes = dict(zip((TRAIN, GEN), sizes))
        if not self.plans:
            return settings, None
        metas = {side: [wire.metas_from_wire(m, f"{side} rank {r}") for r, m in enumerate(
                     rdv.wait([f"meta/{side}/{r}" for r in range(self.sizes[side])], f"{side} metadata"))]
                 for side in (TRAIN, GEN)}
        return settings, metas

    def _plan(self, settings: RefitOptions, pieces: list[Piece],
              metas: dict[str, list[list[PieceMeta]]] | None) -> Schedule:
        """The planner plans the whole refit and publishes every rank's part; every other rank reads
        its own part (:mod:`refit_core.plan.rankplan`). Each rank holds its part against its own pieces,
        then all agree on the plan's fingerprint (a barrier) before any collective.

        With relay fanout the trainers feed only the first wave's replicas; the relay plan (waves,
        parents, relay messages) is hashed into the fingerprint with the settings."""
        began = time.perf_counter()
        rdv = self._require_rendezvous()
        if metas is not None:
            plan, schedule = self._plan_for_all(settings, metas)
        else:
            (record,) = rdv.wait([f"plan/{self.side}/{self.rank}"],
                                 f"{self.side} rank {self.rank}'s part of the plan from train rank 0")
            plan = rankplan.from_wire(record, self.side, self.rank)
            schedule, self.relay, self.links = plan.schedule(), plan.relay_plan(), plan.links
        self._counts = plan.facts.counts[self.side]
        self._experts.seen.update(plan.experts)
        self._experts.learn([[p.meta for p in pieces]])
        rankplan.check_against(plan, [group_meta(p.meta, self.plugins.expert_name, self._counts) for p in pieces])
        self._network = plan.facts.network
        self._phases["plan"] = time.perf_counter() - began
        began = time.perf_counter()
        rdv.publish(f"fingerprint/{self.side}/{self.rank}", plan.facts.fingerprint)
        rdv.barrier("agreed", sum(self.sizes.values()), self._rank_keys("fingerprint"),
                    f"every rank to agree on plan {plan.facts.fingerprint}")
        self._phases["agree"] = time.perf_counter() - began
        return schedule

    def _plan_for_all(self, settings: RefitOptions,
                      metas: dict[str, list[list[PieceMeta]]]) -> tuple[rankplan.RankPlan, Schedule]:
        """The planner: plan once, publish every other rank's part; this rank's part and the whole schedule."""
        rdv = self._require_rendezvous()
        grouped = {side: group_side(metas[side], self.plugins.expert_name) for side in (TRAIN, GEN)}
        for side in (TRAIN, GEN):
            self._experts.learn(metas[side])
        groups = set(grouped[GEN].counts) | set(grouped[TRAIN].counts)
        with gc_paused():
            schedule, self.relay = plan_with_relay(grouped[TRAIN].metas, grouped[GEN].metas, settings,
                                                   expert_groups=groups)
        self._assign_links(schedule, settings)
        relay = self.relay
        facts = rankplan.PlanFacts(
            schedule.fingerprint, schedule.num_src, schedule.num_dst, schedule.bucket_bytes, schedule.summary,
            relay is not None or any(link is Link.NETWORK for link in self.links.values()),
            {side: grouped[side].counts for side in (TRAIN, GEN)},
            None if relay is None else rankplan.RelayFacts(relay.replica_size, relay.waves, relay.wave_rounds,
                                                           relay.schedule.fingerprint, relay.schedule.summary,
                                                           relay.node_ranks))
        record = rankplan.facts_to_wire(facts)
        mine = None
        for part in rankplan.rank_plans(facts, schedule, relay, self.links,
                                        {side: grouped[side].metas for side in (TRAIN, GEN)}, dict(self._experts.seen)):
            if (part.side, part.rank) == (self.side, self.rank):
                mine = part
            else:
                rdv.publish(f"plan/{part.side}/{part.rank}", rankplan.to_wire(part, record))
        assert mine is not None
        return mine, schedule

    def _assign_links(self, schedule: Schedule, settings: RefitOptions) -> None:
        """Every pair's link (:mod:`~refit_core.plan.links`), on the planner; a pair no
        transport can connect (same GPU, colocation off) is refused before any collective."""
        rdv = self._require_rendezvous()
        places = {side: [Placement.decode(text) for text in
                         rdv.wait([f"placement/{side}/{r}" for r in range(n)], f"{side} placements")]
                  for side, n in self.sizes.items()}
        pairs = {(m.src, m.dst) for msgs in schedule.rounds for m in msgs}
        self.links = pair_links(pairs, places[TRAIN], places[GEN], settings.colocate)
        if self.relay is not None:
            check_relay_pairs(self.relay, places[GEN])

    def _is_network(self, m: Message) -> bool:
        return self.links[(m.src, m.dst)] is Link.NETWORK

    def _require_rendezvous(self) -> Rendezvous:
        if self._rdv is None:
            raise RefitError(f"the {self.side} side's rendezvous is closed")
        return self._rdv

    def _require_setup(self) -> None:
        if self.settings is None or (self._executor is None and self._colocated is None):
            raise RefitError(f"call setup() on the {self.side} side before the first step")

    def _require_executor(self) -> SendExecutor | ReceiveExecutor:
        self._require_setup()
        if self._executor is None:
            raise RefitError(f"{self.side} rank {self.rank} has no network pairs (all its pairs are colocated)")
        return self._executor

    @property
    def executor(self) -> SendExecutor | ReceiveExecutor:
        """This rank's network executor (after setup): its rounds, staging and zero-copy bytes."""
        return self._require_executor()

    @property
    def colocated_copies(self) -> int:
        """How many copy launches a gen rank runs per step for its colocated pairs (0 if none)."""
        return getattr(self._colocated, "copies", 0)

    @property
    def colocated_trace(self) -> StepTrace | None:
        """The last step's colocated :class:`~refit_core.run.timing.StepTrace` (with
        ``RefitOptions(step_trace=True)`` and colocated pairs; else None)."""
        return getattr(self._colocated, "trace", None)

    @property
    def colocated_counts(self) -> CopyCounts | None:
        """What a gen rank's colocated copies look like after batching (None if it has none)."""
        return self._colocated.counts if isinstance(self._colocated, ColocatedReceiver) else None

    def _rank_keys(self, prefix: str) -> list[str]:
        return [f"{prefix}/{side}/{r}" for side, n in self.sizes.items() for r in range(n)]

    def _abort_setup(self, exc: Exception) -> None:
        """Tell every rank why setup failed; the store's host waits until they have read it."""
        rdv = self._require_rendezvous()
        rdv.fail(exc, f"{self.side} rank {self.rank}", f"done/{self.side}/{self.rank}")
        if self._hosts_store:
            if not self.sizes:  # failed before learning the gen side's size: wait for it to show up
                rdv.linger(["size/gen"], timeout_s=self.options.timeout_s)
                self.sizes = {TRAIN: self.world_size, GEN: rdv.read("size/gen", default=0)}
            rdv.linger(self._rank_keys("done"), timeout_s=self.options.timeout_s)
        self.close()

    def _global_rank(self) -> int:
        """Train ranks come first in refit's own process group, then gen ranks."""
        return self.rank if self.side == TRAIN else self.sizes[TRAIN] + self.rank

    def _make_executors(self, schedule: Schedule, settings: RefitOptions) -> None:
        """This rank's network executor (pairs over NCCL / gloo) and colocated part, each if it has any."""
        raise NotImplementedError

    def _network_executor_args(self, schedule: Schedule, settings: RefitOptions) -> dict:
        assert settings.bucket_bytes is not None
        return dict(bucket_bytes=settings.bucket_bytes, num_buffers=settings.num_buffers,
                    zero_copy=settings.messages.zero_copy, fingerprint=schedule.fingerprint,
                    timeout_s=settings.timeout_s, mode=settings.mode)

    def _bind(self, pieces: list[Piece]) -> None:
        """Re-check every view (see :mod:`refit_core.run.validate`), then resolve the schedule onto them."""
        began = time.perf_counter()
        grouped = [group_piece(p, self.plugins.expert_name, self._counts) for p in pieces]
        if any(p.view is None for p in grouped):
            raise RefitError(f"{self.side} rank {self.rank}: a piece without a view cannot be bound")
        writes = self.side == GEN
        for p in grouped:
            check_view(p.spec, p.box, p.view, destination=writes)
        engine = [p.view for p in grouped if p.view is not None]
        if writes:
            check_no_overlap([p.spec.name for p in grouped], engine)
        self._bound_names = [p.spec.name for p in grouped]
        views = self._bound_views(engine)
        if isinstance(self._colocated, ColocatedSender) and not self._colocated_bound:
            # first: on CPU, exporting moves the storages into shared memory (in place)
            self._colocated.export(views, self._bound_names)
            self._colocated_bound = True
        elif isinstance(self._colocated, ColocatedReceiver):
            self._colocated.bind(views)
        if self._executor is not None:
            self._executor.bind(views)
        if self._relay_out is not None:
            self._relay_out.bind(views)
        if self._bind_s is None:
            self._bind_s = time.perf_counter() - began

    def _bound_views(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The views the executors read or write, in place of the pieces' own (default: those)."""
        return views

    def _require_step(self) -> None:
        self._require_setup()
        if self._broken is not None:
            raise TransferError(f"refit {self.side} rank {self.rank}: a previous step failed ({self._broken[:300]}); "
                                "call close() and setup() again before the next step")

    @property
    def _mode(self) -> UpdateMode:
        assert self.settings is not None
        return self.settings.mode

    def _break(self, reason: str) -> None:
        """A step failed: drop the transport at once, so that peers still in the step see its
        connection close and stop within seconds instead of at their deadline."""
        self._broken = reason
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.close()

    def _landing_keys(self, step: int) -> list[str]:
        return [f"landed/{step}/gen/{r}" for r in range(self.sizes[GEN])]

    def _await_landing(self, step: int) -> None:
        """Staged mode: wait until every gen rank says whether it landed ``step``; raise if one did not."""
        try:
            verdicts = self._require_rendezvous().wait(self._landing_keys(step), f"every gen rank to land step {step}")
        except RefitError as exc:
            raise TransferError(f"step {step} was not applied on any gen rank (staged mode): {exc}") from exc
        failed = [(r, v) for r, v in enumerate(verdicts) if not (isinstance(v, dict) and v.get("ok") is True)]
        if failed:
            rank, verdict = failed[0]
            reason = verdict.get("reason") if isinstance(verdict, dict) else verdict
            raise TransferError(f"gen rank {rank} did not land step {step} ({str(reason)[:300]}); "
                                "no gen rank applied it (staged mode): the engine keeps its previous weights")

    def close(self) -> None:
        """Release the transport, the colocated peers' memory and the rendezvous (the host stops its
        store and frees the port).

        Safe after any failure; ``setup()`` may be called again afterwards, on the same address.
        """
        transport, colocated, rdv = self.transport, self._colocated, self._rdv
        self.transport, self._colocated, self._executor, self._rdv = None, None, None, None
        self._relay_out = None
        if transport is not None:
            transport.close()
        if colocated is not None:
            colocated.close()
        if rdv is not None:
            rdv.close()


class RefitSender(_Endpoint):
    """The train side of a refit, one per train rank. ``send(version)`` every step."""

    side = TRAIN
    _signature: list[tuple[object, object, int]] | None = None  # the source pieces bound at setup

    def _local_pieces(self) -> list[Piece]:
        pieces: list[Piece] = list(self.plugins.source_pieces(self.model))
        missing = [p.spec.name for p in pieces if p.view is None]
        if missing:
            raise RefitError(f"source pieces without views: {missing[:5]}")
        return pieces

    def _make_executors(self, schedule: Schedule, settings: RefitOptions) -> None:
        network, colocated = split_rounds(schedule.rounds_of_source(self.rank), self._is_network)
        if network:
            assert self.transport is not None
            self._executor = SendExecutor(network, self.transport, self.sizes[TRAIN],
                                          **self._network_executor_args(schedule, settings))
        if colocated:
            self._colocated = ColocatedSender(by_peer(colocated, lambda m: m.dst), self._require_rendezvous().store,
                                              self.rank, self.device, schedule.fingerprint, settings.timeout_s,
                                              trace=settings.step_trace)

    def setup(self) -> Schedule:
        schedule = super().setup()
        self._bind(self._pieces)
        self._signature = _source_signature(self._pieces)
        return schedule

    def _moved_sources(self, colocated: ColocatedSender) -> str | None:
        """What the trainer freed, replaced or moved since setup (colocated engines read it in place).

        Runs before every colocated step, on its critical path: the common case (nothing changed) is
        one comparison of (spec, box, address) per piece; only a difference is diagnosed in detail."""
        problem = colocated.check()
        if problem is not None:
            return problem
        current = self._local_pieces()
        if _source_signature(current) == self._signature:
            return None
        if [p.meta for p in current] != [p.meta for p in self._pieces]:
            return "the trainer's source pieces changed since setup(); call setup() again after changing the model"
        for now, bound in zip(current, self._pieces):
            assert now.view is not None and bound.view is not None
            if (now.view.data_ptr() != bound.view.data_ptr()
                    or now.view.untyped_storage().data_ptr() != bound.view.untyped_storage().data_ptr()):
                return (f"source tensor {now.spec.name}{now.box} now lives at a different address than at "
                        "setup (the trainer replaced or moved the parameter; a colocated engine reads it in "
                        "place: update parameters in place between setup() and close())")
        return None

    def send(self, version: int) -> StepStats:
        """Send the model's current weights as weight ``version``; returns this rank's step stats.

        With colocated peers this first checks that every source tensor is still the memory shared at
        setup; if not, the step fails on this rank and on its colocated peers, naming the tensor.
        In staged mode it returns once every gen rank has landed the step. After a failure
        (:class:`~refit_core.contract.errors.TransferError`), ``close()`` and ``setup()`` again.
        """
        self._require_step()
        step, self._steps = self._steps, self._steps + 1
        start = time.perf_counter()
        colocated = self._colocated
        executor = self._executor
        assert executor is None or isinstance(executor, SendExecutor)
        try:
            if isinstance(colocated, ColocatedSender):
                colocated.mark("start")
                if self.settings is not None and self.settings.overlap_check:  # the engine copies meanwhile
                    colocated.post(version, verdict=True)
                    problem = self._moved_sources(colocated)
                    colocated.post_verdict(problem)
                else:
                    problem = self._moved_sources(colocated)
                    colocated.post(version, problem)
                if problem is not None:
                    raise TransferError(f"train rank {self.rank}: {problem}")
            stats = executor.run(version) if executor is not None else None
            if isinstance(colocated, ColocatedSender):
                colocated.wait()
            stats = _combined(stats, version, colocated, start)
            if self._mode is UpdateMode.STAGED:
                self._await_landing(step)
            if isinstance(colocated, ColocatedSender):
                colocated.mark("end")
        except Exception as exc:
            self._break(str(exc))
            if isinstance(exc, RefitError):
                raise
            raise TransferError(f"refit step {step} failed on train rank {self.rank}: {exc}") from exc
        log.info("refit sent version %d: %s in %.3f s (%.2f GB/s)", version, format_bytes(stats.bytes),
                 stats.seconds, stats.gbps)
        return stats


class RefitReceiver(_Endpoint):
    """The gen side of a refit, one per gen rank. ``receive()`` every step lands one weight version."""

    side = GEN

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None) -> None:
        super().__init__(model, rendezvous=rendezvous, rank=rank, world_size=world_size, options=options,
                         plugins=plugins, host_id=host_id)
        self._loader: list[TensorSpec] = []
        """The logical tensors of the loader path (received whole, handed to ``refit_load_weights``)."""
        self._bound = False
        self._quantizing = ReceiverQuantizer(())
        """This rank's receiver-side quantizations (set at setup from the schedule)."""

    def _local_pieces(self) -> list[Piece]:
        """The destination map's pieces, then one whole piece per loader tensor (recorded in ``_loader``)."""
        mapping = self.plugins.destination_map(self.model)
        self._loader = list(mapping.loader)
        loader: list[Piece] = [DestinationPiece(spec, spec.full_box()) for spec in self._loader]
        return [*mapping.pieces, *loader]

    def _make_executors(self, schedule: Schedule, settings: RefitOptions) -> None:
        self._quantizing = ReceiverQuantizer(schedule.receiver_quantizations_of(self.rank))
        network, colocated = split_rounds(schedule.rounds_of_destination(self.rank), self._is_network)
        if network:
            assert self.transport is not None
            self._executor = ReceiveExecutor(network, self.transport, 0,
                                             **self._network_executor_args(schedule, settings))
        if self.relay is not None:
            self._make_relay_executors(self.relay, schedule, settings)
        if colocated:
            receiver = ColocatedReceiver(by_peer(colocated, lambda m: m.src), self._require_rendezvous().store,
                                         self.rank, self.device, schedule.fingerprint, settings.timeout_s,
                                         strided=settings.strided_copies, trace=settings.step_trace)
            receiver.open()
            self._colocated = receiver

    def _make_relay_executors(self, relay: RelayPlan, schedule: Schedule, settings: RefitOptions) -> None:
        """A relayed rank receives its step from its parent replica's rank (its network executor); a
        rank with children forwards to them after its own step landed (``_relay_out``). Forwarding
        within nodes: after its own step landed, a rank sends the regions it leads to its node's other
        holders and receives the ones they lead, in one exchange per round (``_relay_out``)."""
        assert self.transport is not None  # always opened with relay
        offset = self.sizes[TRAIN]  # relay peers are gen ranks: global rank = train ranks + gen rank
        if relay.within_nodes:
            rounds = relay.schedule.rounds  # this rank's part: every round, both directions
            if any(rounds):
                self._relay_out = ForwardExecutor(self.rank, rounds, self.transport, offset,
                                                  **self._network_executor_args(schedule, settings))
            return
        incoming = relay.schedule.rounds_of_destination(self.rank)
        if incoming:
            if self._executor is not None:
                raise PlanError(f"refit bug: gen rank {self.rank} is fed by trainers and by a relay")
            self._executor = ReceiveExecutor(incoming, self.transport, offset,
                                             **self._network_executor_args(schedule, settings))
        outgoing = relay.schedule.rounds_of_source(self.rank)
        if outgoing:
            self._relay_out = SendExecutor(outgoing, self.transport, offset,
                                           **self._network_executor_args(schedule, settings))

    def _bound_views(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._quantizing.bind(views)  # receiver-quantized pieces land in high precision first

    def _bind_step(self) -> list[tuple[str, torch.Tensor]]:
        """(Re)bind destination views for this step; returns the fresh loader-path tensors."""
        rebind = self.plugins.begin_update(self.model)
        if rebind:
            pieces = self._local_pieces()
            if [p.meta for p in pieces] != [p.meta for p in self._pieces]:
                raise RefitError("the generation model's destination pieces changed after "
                                 "refit_begin_update; a plugin must return the same pieces every time")
            self._pieces = pieces
        if not self._loader:
            if rebind or not self._bound:
                self._bind(self._pieces)
                self._bound = True
            return []
        fast = len(self._pieces) - len(self._loader)
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in self._loader]
        loaded: list[Piece] = [DestinationPiece(s, s.full_box(), b) for s, b in zip(self._loader, buffers)]
        self._bind(self._pieces[:fast] + loaded)
        return [(s.name, b) for s, b in zip(self._loader, buffers)]

    version: int | None = None  # the weight version the engine holds (None: none from refit yet)
    last_failure: StepFailure | None = None

    @property
    def needs_refit(self) -> bool:
        """True while the engine holds weights a failed in-place step tore: serve nothing until the
        next successful ``receive()`` (after ``close()`` and ``setup()``)."""
        return self.last_failure is not None and not self.last_failure.clean

    def receive(self) -> StepStats:
        """Receive one step's weights into the engine; ``stats.version`` is the sender's version.

        On failure raises :class:`~refit_core.contract.failures.StepFailedError`, whose ``failure`` names the
        destination tensors the step touched (none in staged mode, unless colocated pairs, which land in
        place, had started); ``version`` is not advanced, the plugin's ``refit_abort_update`` is told,
        and the endpoint needs ``close()`` + ``setup()``.
        """
        self._require_step()
        step, self._steps = self._steps, self._steps + 1
        touched: set[int] = set()
        self._quantizing.begin_step()
        for executor in (self._executor, self._relay_out):
            if isinstance(executor, ReceiveExecutor | ForwardExecutor):
                executor.touched = set()  # this step's, also if binding fails before it runs
        loader_weights: list[tuple[str, torch.Tensor]] = []
        voted = False
        try:
            loader_weights = self._bind_step()
            stats = self._receive_parts(touched)
            if self._relay_out is not None:  # forward only what has fully landed here
                self._relay_out.run(stats.version)
            if self._mode is UpdateMode.STAGED:
                self._require_rendezvous().publish(self._landing_keys(step)[self.rank], {"ok": True})
                voted = True
                self._await_landing(step)
                if isinstance(self._executor, ReceiveExecutor):
                    self._executor.commit()
            self._quantizing.finish()
            if loader_weights:
                touched.update(range(len(self._bound_names) - len(loader_weights), len(self._bound_names)))
                self.plugins.load_weights(self.model, self._experts.ungrouped(loader_weights))
        except Exception as exc:
            raise self._step_failed(step, exc, voted, touched) from exc
        self.plugins.finish_update(self.model, stats.version)
        self.version = stats.version
        self.last_failure = None
        log.info("refit received version %d: %s in %.3f s (%.2f GB/s)", stats.version,
                 format_bytes(stats.bytes), stats.seconds, stats.gbps)
        return stats

    def _receive_parts(self, touched: set[int]) -> StepStats:
        """This step's network part and colocated part; colocated peers hear of any failure.
        ``touched`` gathers the bound pieces whose destinations may have been written."""
        executor, colocated = self._executor, self._colocated
        assert executor is None or isinstance(executor, ReceiveExecutor)
        if not isinstance(colocated, ColocatedReceiver):
            assert executor is not None
            return executor.run()
        start = time.perf_counter()
        version = colocated.start()  # on a bad header it has told its peers already
        touched |= colocated.pieces  # colocated copies land in place, also in staged mode
        try:
            stats = executor.run(version) if executor is not None else None
            if stats is not None and stats.version != version:
                raise TransferError(f"train ranks sent different weight versions {sorted({version, stats.version})} "
                                    "in one step: every train rank must call send() with the same version")
        except Exception as exc:
            colocated.finish(error=f"gen rank {self.rank}: {exc}")
            raise
        colocated.finish()
        return _combined(stats, version, colocated, start)

    def _step_failed(self, step: int, exc: Exception, voted: bool, touched: set[int]) -> StepFailedError:
        """Record what a failed step touched, tell the peers and the plugin; the error to raise."""
        executor = self._executor
        if isinstance(executor, ReceiveExecutor):
            touched |= executor.touched
            executor.discard()
        if isinstance(self._relay_out, ForwardExecutor):
            touched |= self._relay_out.touched
        touched = self._quantizing.torn(touched)  # receiver-quantized pieces land in stand-ins first
        if self._mode is UpdateMode.STAGED and not voted and self._rdv is not None:
            try:
                self._rdv.publish(self._landing_keys(step)[self.rank], {"ok": False, "reason": str(exc)[:500]})
            except RefitError:
                pass  # the store's host is gone: the others fail on that too
        names = sorted({self._bound_names[i] for i in touched if i < len(self._bound_names)})
        failure = StepFailure(step, self._mode, str(exc), tuple(names))
        self.last_failure = failure
        self._break(str(exc))
        handled = self.plugins.abort_update(self.model, list(failure.torn))
        if failure.clean:
            outcome = "the engine's weights are unchanged"
        else:
            outcome = (f"{len(names)} destination tensor(s) may be partly written (torn): "
                       f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}; the engine needs a new "
                       f"refit and stays at version {self.version}")
        error = StepFailedError(f"refit step {step} failed on gen rank {self.rank}: {exc}; {outcome}", failure)
        if handled is False:
            error.add_note(f"refit: gen rank {self.rank}: the engine could not restore its previous weights "
                           "(refit_abort_update returned False); it may hold a mix of versions until the "
                           "next successful receive()")
        return error


def _source_signature(pieces: Sequence[Piece]) -> list[tuple[object, object, int]]:
    """Per source piece, what a colocated engine relies on: its tensor, its box and its address."""
    return [(p.spec, p.box, p.view.data_ptr() if p.view is not None else 0) for p in pieces]


def _combined(network: StepStats | None, version: int, colocated: ColocatedSender | ColocatedReceiver | None,
              start: float) -> StepStats:
    """One rank's stats of a step over its network part and its colocated part."""
    extra = colocated.nbytes if colocated is not None else 0
    if network is None:
        return StepStats(version, extra, time.perf_counter() - start, 0, extra)
    return StepStats(network.version, network.bytes + extra, time.perf_counter() - start,
                     network.staging_bytes, network.direct_bytes + extra)


__all__ = ["RefitReceiver", "RefitSender", "StepStats"]
