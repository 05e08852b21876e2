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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import is_, itemgetter
from typing import Any, ClassVar

import torch

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import RefitError, TransferError
from refit_core.contract.experts import ExpertNaming, group_meta, group_piece
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.pieces import Piece, PieceMeta
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.side import Side
from refit_core.endpoints import agreement
from refit_core.net.auth import JobCredentials
from refit_core.net.keys import RankId, RankRecord, rank_key, rank_keys, size_key, subset_key
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.transport import StoreWatch, Transport, open_transport
from refit_core.plan import rankplan
from refit_core.plan.items import Message
from refit_core.plan.links import Link
from refit_core.plan.relay import RelayPlan
from refit_core.plan.schedule import Schedule
from refit_core.plan import subset
from refit_core.plan.subset import SubSchedules, Subset
from refit_core.run.colocated import ColocatedReceiver, ColocatedSender
from refit_core.run.copies import CopyCounts
from refit_core.run.executor import ForwardExecutor, ReceiveExecutor, SendExecutor, StepStats
from refit_core.run.timing import SetupTimes, StepTrace
from refit_core.run.validate import check_no_overlap, check_view
from refit_core.units import format_bytes

log = logging.getLogger("refit")


class RefitEndpoint:
    """What both sides share: setup (metadata exchange, agreement, planning, transport) and teardown.

    ``options`` are this rank's wishes, with the environment's overrides applied
    (:mod:`refit_core.contract.env`); ``settings`` are the options every rank agreed on at setup (the train
    side's rank 0's), None before setup.
    """

    side: ClassVar[Side]
    """Which side this endpoint serves (each subclass says)."""

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
        self.host_id = host_id
        self.settings: RefitOptions | None = None
        self.schedule: Schedule | None = None
        self.transport: Transport | None = None
        self.device = torch.device("cpu")
        self.sizes: dict[Side, int] = {}
        """Each side's world size, learned at setup."""
        self.links: dict[tuple[int, int], Link] = {}
        """The links of this rank's pairs after setup (the planner, train rank 0: every pair's), see
        :mod:`refit_core.plan.links`."""
        self.relay: RelayPlan | None = None
        """The relay fanout plan agreed at setup (None without relay), see :mod:`refit_core.plan.relay`."""
        self._rdv: Rendezvous | None = None
        self._pieces: list[Piece] = []
        self._counts: dict[str, int] = {}
        self._group_sizes: dict[str, int] = {}
        """Every grouped expert tensor of the plan (either side's) and its expert count."""
        self._plan_names: frozenset[str] | None = None
        """The planner's (train rank 0's): every logical tensor the train side sends (None elsewhere)."""
        self._experts: ExpertNaming = self.plugins.expert_naming()
        self._executor: SendExecutor | ReceiveExecutor | None = None
        self._relay_out: SendExecutor | ForwardExecutor | None = None
        """A gen rank's forwarding once its step landed: to the next wave's replicas, or within its node."""
        self._network = False  # whether the network transport opens: the planner's answer
        self._colocated: ColocatedSender | ColocatedReceiver | None = None
        self._bound = False  # whether this setup's executors hold the views (a gen rank binds at its first step)
        self._bound_names: list[str] = []
        self._steps = 0  # steps since setup (the commit keys of each step)
        self._broken: str | None = None  # why the last step failed; a new setup() clears it
        self._phases: dict[str, float] = {}
        self._bind_s: float | None = None
        self._identity: BoundTensors | None = None
        """The model's tensors when the pieces were bound (None: no plugin lists them)."""
        self._downloaded = 0
        self._views: list[torch.Tensor] = []
        """The views the executors were last bound to."""
        self._subsets: SubSchedules | None = None
        """This rank's sub-schedules, derived per subset from its network rounds (None: none asked for yet)."""
        self._sub_executors: dict[int, SendExecutor | ReceiveExecutor] = {}
        """The network executor of each subset asked for (by digest), bound to :attr:`_views` when in it."""
        self._sub_bound: set[int] = set()
        self._subset_names: dict[int, frozenset[str]] = {}
        """The subsets this rank moved (by digest), each offered to the store once (:func:`subset_key`)."""
        self._whole: SendExecutor | ReceiveExecutor | None = None
        """The whole schedule's executor while a subset's stands in for it (None outside subset steps)."""

    @property
    def me(self) -> RankId:
        """This rank: its side and rank there."""
        return RankId(self.side, self.rank)

    # -- setup --------------------------------------------------------------------------------

    def _local_pieces(self) -> list[Piece]:
        raise NotImplementedError

    def _make_executors(self, schedule: Schedule, settings: RefitOptions) -> None:
        """This rank's network executor (pairs over NCCL / gloo) and colocated part, each if it has any."""
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
        self._rdv = Rendezvous(self.address, host=self._hosts_store, who=str(self.me),
                               timeout_s=self.options.timeout_s, credentials=credentials, limits=self.options.store)
        self.sizes = {}
        self._phases, self._bind_s = {}, None
        try:
            began = time.perf_counter()
            pieces = self._local_pieces()
            for p in pieces:  # a gen rank's views may be placeholders until its first bind
                if p.view is not None:
                    check_view(p.spec, p.box, p.view, destination=False, placeholder=self.side is Side.GEN)
            self.device = device_of(pieces)
            self._phases["pieces"] = time.perf_counter() - began
            began = time.perf_counter()
            exchange = agreement.exchange_metadata(self._rdv, self.me, self.world_size, self.options, self.device,
                                                   self.host_id, pieces)
            self.sizes = exchange.sizes
            settings = exchange.settings
            metas = agreement.gather_metadata(self._rdv, self.sizes) if self.plans else None
            self._phases["metadata"] = time.perf_counter() - began
            schedule = self._plan(settings, pieces, metas)  # records "plan" and "agree"
            began = time.perf_counter()
            if self._network:  # the planner's answer, the same on every rank (relay always uses it)
                self.transport = self._open_transport(settings)
            self._phases["transport"] = time.perf_counter() - began
            self._downloaded = self._rdv.downloaded
        except Exception as exc:
            self._abort_setup(exc)
            raise
        self.settings = settings
        self.schedule = schedule
        self._broken = None
        self._steps = 0
        self._bound = False  # new executors: bind the views again
        self._rdv.seal()
        self._subsets, self._sub_executors, self._sub_bound = None, {}, set()
        self._make_executors(schedule, settings)
        if self._executor is not None:
            self._executor.explain = self._explain_subsets
        self._pieces = pieces
        summary = schedule.summary
        log.info("refit %s rank %d ready in %.2f s: %s in %d messages over %d rounds, plan %s",
                 self.side, self.rank, time.perf_counter() - start, format_bytes(summary.bytes),
                 summary.messages, summary.rounds, schedule.fingerprint)
        return schedule

    def _plan(self, settings: RefitOptions, pieces: list[Piece],
              metas: dict[Side, list[list[PieceMeta]]] | None) -> Schedule:
        """The planner (given every rank's ``metas``) plans the whole refit and publishes every rank's
        part; every other rank reads its own part (:mod:`refit_core.plan.rankplan`). Each rank holds its
        part against its own pieces, then all agree on the plan's fingerprint (a barrier) before any
        collective."""
        began = time.perf_counter()
        rdv = self._require_rendezvous()
        if metas is not None:
            whole = agreement.plan_for_all(rdv, self.me, settings, self.sizes, metas, self.plugins, self._experts)
            plan, schedule, self.relay, self.links = whole.mine, whole.schedule, whole.relay, whole.links
        else:
            plan = agreement.read_own_part(rdv, self.me)
            schedule, self.relay, self.links = plan.schedule(), plan.relay_plan(), plan.links
        self._counts = plan.facts.counts[self.side]
        self._group_sizes = {group: n for side in Side for group, n in plan.facts.counts[side].items()}
        if metas is not None:
            namer = self.plugins.expert_name
            self._plan_names = frozenset(subset.logical_name(m.spec.name, namer, self._group_sizes)
                                         for ranks in metas[Side.TRAIN] for m in ranks)
        self._experts.seen.update(plan.experts)
        self._experts.learn([[p.meta for p in pieces]])
        rankplan.check_against(plan, [group_meta(p.meta, self.plugins.expert_name, self._counts) for p in pieces])
        self._network = plan.facts.network
        self._check_plan(schedule, pieces)
        self._phases["plan"] = time.perf_counter() - began
        began = time.perf_counter()
        agreement.agree(rdv, self.me, plan.facts.fingerprint, self.sizes)
        self._phases["agree"] = time.perf_counter() - began
        return schedule

    def _prepare_network_executor(self, executor: SendExecutor | ReceiveExecutor) -> None:
        """Give a network executor this rank's per-piece settings before it is bound: the whole schedule's
        at setup, and each subset's when it is derived (default: none)."""

    def _check_plan(self, schedule: Schedule, pieces: list[Piece]) -> None:
        """Refuse (raise) a plan this rank cannot run with its ``pieces``, before the agreement barrier, so
        that every rank learns why (default: every plan is fine)."""

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
        """Open the transport (every rank passed the agreement barrier: all are ready to); a failure on any
        rank stops them all."""
        from refit_core.net.transport import resolve_kind  # the lead may hoist this to the module's imports

        rdv = self._require_rendezvous()
        kind = resolve_kind(settings.transport, self.device)
        options = settings.options_for(kind)  # an unknown name raises in open_transport, before any collective
        try:
            return open_transport(kind, rdv.store, self._global_rank(), sum(self.sizes.values()), self.device,
                                  settings.timeout_s, options, watch=StoreWatch(rdv.store, self.sizes),
                                  rendezvous=self.address)
        except RefitError:
            raise
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise RefitError(f"the {kind} transport did not open: {exc}") from exc

    @property
    def _hosts_store(self) -> bool:
        return self.me == RankId(Side.TRAIN, 0)

    @property
    def plans(self) -> bool:
        """Whether this rank is the planner (train rank 0, the store's host): it alone reads every
        rank's metadata and plans; every other rank reads only its own part of the plan."""
        return self._hosts_store

    def _abort_setup(self, exc: Exception) -> None:
        """Tell every rank why setup failed; the store's host waits until they have read it."""
        rdv = self._require_rendezvous()
        if self.me.rank == 0 or not self.sizes:  # the host learns how many ranks must read the error
            rdv.offer(size_key(self.side), self.world_size)
        rdv.fail(exc, self.me.name, rank_key(RankRecord.DONE, self.me))
        if self._hosts_store:
            if not self.sizes:  # failed before learning the gen side's size: wait for it to show up
                rdv.linger([size_key(Side.GEN)], timeout_s=self.options.timeout_s)
                self.sizes = {Side.TRAIN: self.world_size, Side.GEN: rdv.read(size_key(Side.GEN), default=0)}
            rdv.linger(rank_keys(RankRecord.DONE, self.sizes), timeout_s=self.options.timeout_s)
        self.close()

    def _global_rank(self) -> int:
        """Train ranks come first in refit's own process group, then gen ranks."""
        return self.rank if self.side is Side.TRAIN else self.sizes[Side.TRAIN] + self.rank

    def _is_network(self, m: Message) -> bool:
        return self.links[(m.src, m.dst)] is Link.NETWORK

    def _network_executor_args(self, schedule: Schedule, settings: RefitOptions) -> dict[str, Any]:
        assert settings.bucket_bytes is not None
        return dict(bucket_bytes=settings.bucket_bytes, num_buffers=settings.num_buffers,
                    zero_copy=settings.messages.zero_copy, fingerprint=schedule.fingerprint,
                    timeout_s=settings.timeout_s, mode=settings.mode)

    # -- state --------------------------------------------------------------------------------

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
            raise TransferError(f"refit {self.side} rank {self.rank}: a previous step failed ({self._broken[:300]}); "
                                "call close() and setup() again before the next step")

    @property
    def executor(self) -> SendExecutor | ReceiveExecutor:
        """This rank's network executor (after setup): its rounds, staging and zero-copy bytes."""
        self._require_setup()
        if self._executor is None:
            raise RefitError(f"{self.side} rank {self.rank} has no network pairs (all its pairs are colocated)")
        return self._executor

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

    @property
    def _mode(self) -> UpdateMode:
        assert self.settings is not None
        return self.settings.mode

    # -- binding ------------------------------------------------------------------------------

    def _bind(self, pieces: list[Piece]) -> None:
        """Re-check every view (see :mod:`refit_core.run.validate`), then resolve the schedule onto them."""
        began = time.perf_counter()
        grouped = [group_piece(p, self.plugins.expert_name, self._counts) for p in pieces]
        if any(p.view is None for p in grouped):
            raise RefitError(f"{self.side} rank {self.rank}: a piece without a view cannot be bound")
        writes = self.side is Side.GEN
        for p in grouped:
            check_view(p.spec, p.box, p.view, destination=writes)
        engine = [p.view for p in grouped if p.view is not None]
        if writes:
            check_no_overlap([p.spec.name for p in grouped], engine)
        self._bound_names = [p.spec.name for p in grouped]
        views = self._bound_views(engine)
        self._views, self._sub_bound = views, set()
        if isinstance(self._colocated, ColocatedSender) and not self._bound:
            # first: on CPU, exporting moves the storages into shared memory (in place)
            self._colocated.export(views, self._bound_names)
        elif isinstance(self._colocated, ColocatedReceiver):
            self._colocated.bind(views)
        if self._executor is not None:
            self._executor.bind(views)
        if self._relay_out is not None:
            self._relay_out.bind(views)
        self._bound = True
        self._identity = self._tensor_identity()
        if self._bind_s is None:
            self._bind_s = time.perf_counter() - began

    def _tensor_identity(self) -> BoundTensors | None:
        """The model's tensors as its plugin lists them (``refit_model_tensors``), with the storage each
        uses now; None if no plugin lists them."""
        tensors = self.plugins.model_tensors(self.model)
        return None if tensors is None else BoundTensors.of(tensors)

    def _replaced_tensor(self) -> str | None:
        """The first of the model's tensors (``refit_model_tensors``) replaced or moved since the pieces
        were bound; None if none was, or if no plugin lists them (the caller then compares pieces)."""
        bound = self._identity
        if bound is None:
            return None
        return bound.first_replaced(self.plugins.model_tensors(self.model) or [])

    def _bound_views(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The views the executors read or write, in place of the pieces' own (default: those)."""
        return views

    # -- subsets ------------------------------------------------------------------------------

    def subset_of(self, names: Iterable[str]) -> Subset:
        """The :class:`~refit_core.plan.subset.Subset` a step naming ``names`` moves (see
        :func:`~refit_core.plan.subset.subset_of`; the planner also refuses names the plan does not move)."""
        return subset.subset_of(names, self.plugins.expert_name, self._group_sizes, self._plan_names)

    def _subset_refusal(self) -> str | None:
        """Why this rank cannot run a subset step (None: it can)."""
        if self._colocated is not None:
            return "it has colocated pairs (CUDA IPC / shared memory), which move the whole plan"
        if self.relay is not None:
            return "the refit relays (gen replicas forward the whole plan to each other)"
        return None

    def _enter_subset(self, only: Iterable[str] | None) -> Subset | None:
        """Start a step moving only ``only`` (None: the whole plan): its sub-schedule's executor (derived
        and bound once per subset, :mod:`refit_core.plan.subset`) stands in for the whole one's until
        :meth:`_leave_subset`. Its headers go to every peer of the whole schedule with the subset's digest,
        so a peer running another subset fails the step on both ends before any byte moves."""
        if only is None:
            return None
        chosen = self.subset_of(only)
        why = self._subset_refusal()
        if why is not None:
            raise RefitError(f"{self.side} rank {self.rank} cannot move a subset of the plan in one step: {why}")
        if chosen.digest not in self._subset_names:  # for the error of a peer moving another subset
            self._subset_names[chosen.digest] = chosen.names
            self._require_rendezvous().offer(subset_key(chosen.digest), sorted(chosen.names))
        whole = self._executor
        if whole is None:
            return chosen  # no network pairs here: nothing moves either way
        if self._subsets is None:
            self._subsets = SubSchedules(whole.rounds, self._bound_names, sender=self.side is Side.TRAIN)
        executor = self._sub_executors.get(chosen.digest)
        if executor is None:
            assert self.schedule is not None and self.settings is not None
            executor = type(whole)(self._subsets.rounds_for(chosen), whole.transport, whole.peer_offset,
                                   **self._network_executor_args(self.schedule, self.settings))
            self._prepare_network_executor(executor)
            executor.subset = (chosen.digest, len(chosen))
            executor.header_peers = whole.peers()
            executor.explain = self._explain_subsets
            self._sub_executors[chosen.digest] = executor
        if chosen.digest not in self._sub_bound:
            executor.bind(self._views)
            self._sub_bound.add(chosen.digest)
        executor.step = whole.step
        self._whole, self._executor = whole, executor
        return chosen

    def _names_of(self, digest: int) -> frozenset[str] | None:
        """The names of the subset ``digest`` (this rank's, or as its first mover offered them), else None."""
        if digest in self._subset_names:
            return self._subset_names[digest]
        names = self._rdv.read(subset_key(digest)) if self._rdv is not None else None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return frozenset(names)
        return None

    def _explain_subsets(self, theirs: tuple[int, int], ours: tuple[int, int]) -> str:
        """What the peer's subset ``theirs`` moves that this rank's ``ours`` does not, and the reverse."""
        return subset.difference(theirs[0], self._names_of(theirs[0]), ours[0], self._names_of(ours[0]))

    def _leave_subset(self) -> None:
        """End a subset step: the whole schedule's executor is back, its step count level with the subset's."""
        whole, self._whole = self._whole, None
        if whole is None:
            return
        if self._executor is not None:
            whole.step = self._executor.step
            self._executor = whole

    # -- teardown -----------------------------------------------------------------------------

    def _break(self, reason: str) -> None:
        """A step failed: drop the transport at once, so that peers still in the step see its
        connection close and stop within seconds instead of at their deadline."""
        self._broken = reason
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.abort(reason)

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


def device_of(pieces: list[Piece]) -> torch.device:
    """The one device a rank's pieces live on (CPU if none has a view); :class:`RefitError` if several."""
    devices = {p.view.device for p in pieces if p.view is not None}
    if len(devices) > 1:
        raise RefitError(f"pieces live on several devices {sorted(map(str, devices))}; one device per rank")
    return devices.pop() if devices else torch.device("cpu")


@dataclass(frozen=True)
class BoundTensors:
    """A model's tensors as refit bound them: each object and the address of its first element
    (``data_ptr()``: it changes when the storage is replaced, moved or freed, and reading it costs no
    storage object, which on CUDA is most of a per-step check's time).

    Checked before every step, on its critical path: the common case (nothing changed) is two passes
    of C calls over the tensors (``map``), a few microseconds per hundred tensors."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    addresses: tuple[int, ...]

    @classmethod
    def of(cls, named: Sequence[tuple[str, torch.Tensor]]) -> BoundTensors:
        tensors = tuple(map(_SECOND, named))
        return cls(tuple(map(_FIRST, named)), tensors, tuple(map(torch.Tensor.data_ptr, tensors)))

    def first_replaced(self, now: Sequence[tuple[str, torch.Tensor]]) -> str | None:
        """The name of the first of ``now`` (the model's tensors listed again) that is another object or
        lives elsewhere than when bound, or what changed in the listing; None if nothing did."""
        if len(now) != len(self.names):
            return f"the model now has {len(now)} tensors, {len(self.names)} when refit bound it"
        tensors = tuple(map(_SECOND, now))
        if all(map(is_, tensors, self.tensors)) and tuple(map(torch.Tensor.data_ptr, tensors)) == self.addresses:
            return None
        for (name, tensor), was, address in zip(now, self.tensors, self.addresses):
            if tensor is not was or tensor.data_ptr() != address:
                return name
        return None


_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def first_moved(current: Sequence[Piece], bound: Sequence[Piece]) -> Piece | None:
    """The first of the ``current`` pieces whose view no longer is the memory of its ``bound`` twin (the
    model replaced the tensor or moved it since it was bound); None if every view is where it was."""
    for now, then in zip(current, bound):
        if now.view is None or then.view is None:
            continue
        if (now.view.data_ptr() != then.view.data_ptr()
                or now.view.untyped_storage().data_ptr() != then.view.untyped_storage().data_ptr()):
            return now
    return None


def split_rounds(rounds: list[list[Message]], network: Callable[[Message], bool]
                 ) -> tuple[list[list[Message]], list[Message]]:
    """A rank's rounds split into the network part (rounds kept in order) and the colocated messages."""
    kept, colocated = [], []
    for msgs in rounds:
        net = [m for m in msgs if network(m)]
        colocated += [m for m in msgs if not network(m)]
        if net:
            kept.append(net)
    return kept, colocated


def by_peer(messages: Sequence[Message], peer: Callable[[Message], int]) -> dict[int, list[Message]]:
    """``messages`` grouped by their ``peer`` rank, each group in the order given."""
    out: dict[int, list[Message]] = {}
    for m in messages:
        out.setdefault(peer(m), []).append(m)
    return out


def combined_stats(network: StepStats | None, version: int, colocated: ColocatedSender | ColocatedReceiver | None,
                   start: float) -> StepStats:
    """One rank's stats of a step over its network part and its colocated part (started at ``start``)."""
    extra = colocated.nbytes if colocated is not None else 0
    if network is None:
        return StepStats(version, extra, time.perf_counter() - start, 0, extra)
    return StepStats(network.version, network.bytes + extra, time.perf_counter() - start,
                     network.staging_bytes, network.direct_bytes + extra)


__all__ = ["RefitEndpoint", "by_peer", "combined_stats", "device_of", "first_moved", "split_rounds"]
