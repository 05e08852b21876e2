"""What both sides of a refit share: an endpoint's setup (agreement, transport, executors), binding and teardown.

Both sides call ``setup()`` once (metadata exchange through the rendezvous store, planning once on
train rank 0, which publishes every other rank its own part of the plan, agreement on the plan's
fingerprint, transport creation: :mod:`.agreement`), then every step the train side calls ``send(version)``
(:mod:`.sender`) and the gen side ``receive()`` (:mod:`.receiver`).
The two sides are separate programs; train rank 0 hosts the rendezvous store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import RefitError, TransferError
from refit_core.contract.experts import ExpertNaming
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.pieces import Piece
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.side import Side
from refit_core.endpoints.binding import BoundMemory, checked_views
from refit_core.endpoints.setup import SetupRequest, set_up
from refit_core.endpoints.subsets import NetworkExecutor, Subsets
from refit_core.net.auth import JobCredentials
from refit_core.net.keys import RankId
from refit_core.net.rendezvous import Abandoned, Rendezvous
from refit_core.net.transport import Transport
from refit_core.plan.planning import PlanCache
from refit_core.plan.items import Message
from refit_core.plan.links import Link
from refit_core.plan.relay import RelayPlan
from refit_core.plan.schedule import Schedule
from refit_core.plan.subset import Subset
from refit_core.run.colocated import ColocatedReceiver, ColocatedSender
from refit_core.run.copies import CopyCounts
from refit_core.run.executor import ForwardExecutor, HeaderScope, StepCount
from refit_core.run.timing import SetupClock, SetupTimes, StepTimeline, StepTrace, Timeline
from refit_core.units import format_bytes

log = logging.getLogger("refit")


class RefitEndpoint:
    """What both sides share: setup (metadata exchange, agreement, planning, transport) and teardown.

    ``options`` are this rank's wishes, with the environment's overrides applied
    (:mod:`refit_core.contract.env`); ``settings`` are the options every rank agreed on at setup (the train
    side's rank 0's), None before setup. ``host_id`` names the memory this rank can share with others
    (default: this machine); ranks with different ids never read each other's memory.
    """

    side: ClassVar[Side]
    """Which side this endpoint serves (each subclass says)."""
    store_host = "train rank 0"
    """Who hosts this job's store, as errors name it (a fleet's feeder replica's rank 0 for the job it serves)."""

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None) -> None:
        if not 0 <= rank < world_size:
            raise RefitError(f"{self.side} rank {rank} is outside world_size {world_size}")
        self.model, self.address, self.rank, self.world_size = model, rendezvous, rank, world_size
        self.options = with_overrides(options or RefitOptions())
        self.plugins = plugins or get_plugin_manager()
        self.host_id = host_id
        self.settings: RefitOptions | None = None
        self.schedule: Schedule | None = None
        self.transport: Transport | None = None
        self.device = torch.device("cpu")
        self.sizes: dict[Side, int] = {}
        """Each side's world size, learned at setup."""
        self.links: dict[tuple[int, int], Link] = {}
        """The links of this rank's pairs after setup (the planner's: every pair's), :mod:`refit_core.plan.links`."""
        self.relay: RelayPlan | None = None
        """The relay fanout plan agreed at setup (None without relay), see :mod:`refit_core.plan.relay`."""
        self.timeline: Timeline | None = None
        """Records every step's spans on this rank's network executor (None, the default: not recorded)."""
        self._rdv: Rendezvous | None = None
        self._pieces: list[Piece] = []
        self._counts: dict[str, int] = {}
        self._experts: ExpertNaming = self.plugins.expert_naming()
        self._executor: NetworkExecutor | None = None
        self._relay_out: ForwardExecutor | None = None
        """A gen rank's forwarding within its node once its step landed (None: none)."""
        self._colocated: ColocatedSender | ColocatedReceiver | None = None
        self._subsets: Subsets | None = None
        self._memory: BoundMemory | None = None
        """What the executors were last bound to (None: not yet; a gen rank binds at its first step)."""
        self._steps = 0  # steps since setup (the commit keys of each step)
        self._broken: str | None = None  # why the last step failed; a new setup() clears it
        self._aborted = False  # True: by abort()
        self._clock = SetupClock()
        self._plans: PlanCache | None = None
        """The planner's plans kept across setups (None: it plans every setup)."""

    @property
    def me(self) -> RankId:
        """This rank: its side and rank there."""
        return RankId(self.side, self.rank)

    @property
    def plans(self) -> bool:
        """Whether this rank is the planner (train rank 0, the store's host): it alone reads every
        rank's metadata and plans; every other rank reads only its own part of the plan."""
        return self.me == RankId(Side.TRAIN, 0)

    # -- what each side says ------------------------------------------------------------------

    def _local_pieces(self) -> list[Piece]:
        raise NotImplementedError

    def _abandoned(self) -> Abandoned | None:
        """Ranks of this job that died before they came to its store, and why it cannot go on, asked whenever
        this rank looks for failures (None: it can; always, here). A fleet's train rank 0 names a replica rank
        that died after the fleet admitted it (:mod:`refit_core.fleet.trainer`)."""
        return None

    def _make_executors(self, schedule: Schedule, settings: RefitOptions, scope: HeaderScope) -> None:
        """This rank's network executor (pairs over NCCL / gloo; its headers claim ``scope``) and colocated part,
        each if it has any."""
        raise NotImplementedError

    def _network_executor(self, rounds: list[list[Message]], scope: HeaderScope, steps: StepCount | None = None
                          ) -> NetworkExecutor:
        """A network executor of this side for ``rounds`` (the whole schedule's, or a subset's)."""
        raise NotImplementedError

    def _check_plan(self, schedule: Schedule, links: dict[tuple[int, int], Link], pieces: list[Piece]) -> None:
        """Refuse (raise) a plan (its ``schedule`` and its pairs' ``links``) this rank cannot run with its
        ``pieces``, before the agreement barrier, so that every rank learns why (default: every plan is fine)."""

    def _bound_views(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The views the executors read or write, in place of the pieces' own (default: those)."""
        return views

    def _subset_refusal(self) -> str | None:
        """Why this rank cannot run a subset step (None: it can)."""
        if self._colocated is not None:
            return "it has colocated pairs (CUDA IPC / shared memory), which move the whole plan"
        if self.relay is not None:
            return "the refit relays (gen replicas forward the whole plan to each other)"
        return None

    # -- setup --------------------------------------------------------------------------------

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
        credentials = JobCredentials.required(self.options, f"{self.side} rank {self.rank}")
        rdv = self._rdv = Rendezvous(self.address, host=self.plans, who=str(self.me), timeout_s=self.options.timeout_s,
                                     credentials=credentials, limits=self.options.store, hosted_by=self.store_host)
        if type(self)._abandoned is not RefitEndpoint._abandoned:  # cleared by close(): no cycle keeps us alive
            rdv.abandoned = self._abandoned
        request = SetupRequest(self.me, self.world_size, self.address, self.options, self.host_id, self.plugins,
                               self._experts, self._local_pieces, self._check_plan, self._plans)
        self._clock = SetupClock()
        try:
            done = set_up(rdv, request, self._clock)
        except Exception:
            self.close()
            raise
        own = done.own
        self.settings, self.schedule, self.relay, self.links = done.settings, own.schedule, own.relay, own.links
        self.device, self.sizes, self.transport, self._pieces = done.device, done.sizes, done.transport, done.pieces
        self._counts = own.part.facts.counts[self.side]
        self._subsets = Subsets(self.side, self.rank, rdv, self.plugins.expert_name, own.groups, own.train_names,
                                self._network_executor)
        self._broken, self._aborted, self._steps, self._memory = None, False, 0, None  # new executors: bind again
        rdv.seal()
        self._make_executors(own.schedule, done.settings, self._subsets.whole_scope)
        summary = own.schedule.summary
        log.info("refit %s rank %d ready in %.2f s: %s in %d messages over %d rounds, plan %s",
                 self.side, self.rank, time.perf_counter() - start, format_bytes(summary.bytes),
                 summary.messages, summary.rounds, own.schedule.fingerprint)
        return own.schedule

    @property
    def _mode(self) -> UpdateMode:
        assert self.settings is not None
        return self.settings.mode

    def _is_network(self, m: Message) -> bool:
        return self.links[(m.src, m.dst)] is Link.NETWORK

    # -- binding and steps --------------------------------------------------------------------

    def _bind(self, pieces: list[Piece]) -> None:
        """Re-check every view (see :mod:`refit_core.run.validate`), then resolve the schedule onto them."""
        began = time.perf_counter()
        names, engine = checked_views(pieces, self.side, self.rank, self.plugins.expert_name, self._counts)
        views = self._bound_views(engine)
        if isinstance(self._colocated, ColocatedSender) and self._memory is None:
            # first: on CPU, exporting moves the storages into shared memory (in place)
            self._colocated.export(views, names)
        elif isinstance(self._colocated, ColocatedReceiver):
            self._colocated.bind(views)
        for executor in (self._executor, self._relay_out):
            if executor is not None:
                executor.bind(views)
        self._memory = BoundMemory.after_bind(names, views, self.plugins.model_tensors(self.model), self._pieces)
        if self._clock.bind_s is None:
            self._clock.bind_s = time.perf_counter() - began

    def _memory_problem(self) -> str | None:
        """What changed in the model's memory since the bind, as the step's error says it (the tensor, the
        side, what changed: a rebinding, ``set_()``, a resize, freed storage); None if nothing did, or if
        nothing is bound yet. Compares the model's tensors as its plugin lists them (``refit_model_tensors``),
        else its pieces, against the objects, addresses and storages recorded at the bind; runs before any
        byte of a step moves, so a failure here is raised where every rank hears of it."""
        memory = self._memory
        if memory is None:
            return None
        if memory.lists:
            change = memory.first_listed_change(self.plugins.model_tensors(self.model))
        else:
            change = memory.first_piece_change(self._local_pieces())
        return None if change is None else change.describe(self.side)

    def _step_executor(self, only: Iterable[str] | None) -> tuple[Subset | None, NetworkExecutor | None]:
        """The subset a step moving ``only`` moves (None: the whole plan) and the network executor it runs."""
        if only is None:
            return None, self._executor
        assert self._subsets is not None and self._memory is not None
        return self._subsets.executor_for(only, self._executor, self._memory, self._subset_refusal())

    def _require_rendezvous(self) -> Rendezvous:
        if self._rdv is None:
            raise RefitError(f"the {self.side} side's rendezvous is closed")
        return self._rdv

    def _require_setup(self) -> None:
        if self.settings is None or (self._executor is None and self._colocated is None):
            raise RefitError(f"call setup() on the {self.side} side before the first step")

    def _require_step(self) -> None:
        self._require_setup()
        if self._broken is not None:
            what = "aborted" if self._aborted else "a previous step failed"
            raise TransferError(f"refit {self.side} rank {self.rank}: {what} ({self._broken[:300]}); "
                                "call close() and setup() again before the next step")

    # -- what the last setup and step did ------------------------------------------------------

    @property
    def setup_times(self) -> SetupTimes | None:
        """Where the last ``setup()`` went (None before one succeeded); ``bind_s`` is None until the
        views were bound (gen ranks bind at their first step)."""
        return self._clock.times(self.plans)

    @property
    def executor(self) -> NetworkExecutor:
        """This rank's network executor (after setup): its rounds, staging and zero-copy bytes."""
        self._require_setup()
        if self._executor is None:
            raise RefitError(f"{self.side} rank {self.rank} has no network pairs (all its pairs are colocated)")
        return self._executor

    @property
    def last_timeline(self) -> StepTimeline | None:
        """The last step's spans recorded with :attr:`timeline` (None: none recorded, or no network pairs)."""
        return None if self._executor is None else self._executor.last_timeline

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

    # -- teardown -----------------------------------------------------------------------------

    def _break(self, reason: str) -> None:
        """A step failed: drop the transport at once, so that peers still in the step see its
        connection close and stop within seconds instead of at their deadline."""
        self._broken = reason
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.abort(reason)

    def abort(self, reason: str) -> None:
        """Give up on the step in progress, from any thread (a client call that failed beside ``send()``):
        ``send()`` / ``receive()`` then raises naming ``reason``, and every peer still in the step stops
        within about a second, hearing it, instead of at its deadline. The endpoint cannot step again
        (``close()``, then ``setup()``). Does nothing before ``setup()`` or after ``close()``."""
        if self.transport is not None:
            self._aborted = True
            self._break(reason)

    def close(self) -> None:
        """Release the transport, the colocated peers' memory and the rendezvous (the host stops its
        store and frees the port).

        Safe after any failure; ``setup()`` may be called again afterwards, on the same address.
        """
        parts = (self._subsets, self.transport, self._colocated, self._rdv)  # each closed once, in this order
        if self._rdv is not None:
            self._rdv.abandoned = None
        self.transport, self._colocated, self._executor, self._rdv = None, None, None, None
        self._relay_out, self._subsets, self._memory = None, None, None  # none of them keeps this endpoint alive
        for part in parts:
            if part is not None:
                part.close()


__all__ = ["RefitEndpoint"]
