"""The ``refit`` backend of vLLM's weight-transfer API, worker side and trainer side.

Worker side (``LLM(..., weight_transfer_config=WeightTransferConfig(backend="refit"))``): each vLLM
worker owns one :class:`RefitWeightTransferEngine`, which owns one :class:`refit_core.RefitReceiver`
(gen rank = the worker's rank among all workers of all engines in the refit). vLLM's own calls drive
it:

- ``init_weight_transfer_engine({"rendezvous": "host:port", ...})``: setup (metadata exchange,
  planning; a mismatched model fails here, before anything is touched);
- ``start_weight_update()``: nothing to do (refit opens vLLM's layerwise reload itself, in step);
- ``update_weights({"version": k})``: receive one step: reload opened, bytes written into the fused
  parameters, loader path, post-processing -- or, on failure, the previous weights restored; with
  ``names`` (vLLM's ``nccl`` update info) or ``only`` naming a subset, exactly those tensors;
- ``finish_weight_update(weight_version="k")``: vLLM publishes the version to request outputs.

Trainer side (``WeightTransferTrainerFactory.trainer_init(RefitTrainerInitInfo(...), client=...,
source=...)``): every train rank owns a :class:`refit_core.RefitSender`; rank 0 also drives the
engine through the client (``VLLMWeightSyncClient``: the four calls above), concurrently with its
own collectives.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    materialize_full_tensor,
)

from refit_core import RefitError, RefitOptions, RefitReceiver, RefitSender, TensorSpec

from . import vllm_plugin
from .checkpoint import UnplannableConfigError, plannable
from .compat import full_tensors, metadata_member, not_on_rank_0, source_metadata
from .held import Declared, HeldWeights
from .lora import AdapterTarget, lora_spec
from .requests import InvalidRequestError, NamedTensor, check_subset, named_tensors, step_names
from .state import attach, refuse_next_step, state_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

log = logging.getLogger("refit.vllm")


@dataclass
class RefitWeightTransferInitInfo(WeightTransferInitInfo):
    """What every vLLM worker needs to join a refit.

    ``world_size``: gen ranks in the refit (all workers of all engines; default: this engine's
    workers). ``rank_offset``: the first gen rank of this engine (for several engines).
    ``options``: :class:`refit_core.RefitOptions` fields. ``loader``: regular expressions of HF
    names forced onto the loader path. ``lora``: adapter mode (:mod:`.lora`): the session moves this
    adapter (``LoraSpec`` fields, or its ``--lora`` text) into the engine's LoRA slots; None: the weights.
    """

    rendezvous: str
    world_size: int | None = None
    rank_offset: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    loader: list[str] = field(default_factory=list)
    lora: dict[str, Any] | str | None = None


@dataclass
class RefitWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One step. ``version``, when given, must equal the version the train side sends.

    ``names`` / ``dtype_names`` / ``shapes`` (vLLM's ``nccl`` update info; None: not given) are checked
    against the engine's HF tensors before any byte lands (:mod:`.requests`): lists of different
    lengths raise ``ValueError`` here, a mismatch fails the step on every rank, naming the tensors.
    Names that are a strict subset of the engine's tensors make a subset step: exactly those move,
    the others keep their bytes. ``only`` (refit's trainer side sends it; None: every tensor) names a
    subset without claims on shapes and dtypes.
    """

    version: int | None = None
    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    only: list[str] | None = None
    tensors: tuple[NamedTensor, ...] | None = field(init=False, default=None, repr=False)
    """The three lists as one, checked for agreement (None: no names given)."""

    def __post_init__(self) -> None:
        self.tensors = named_tensors(self.names, self.dtype_names, self.shapes)


NEVER_PLANNED = "part of the plan from train rank 0"
"""In the timeout of a gen rank whose trainers never planned (one of them may never have come)."""

PARALLEL_FIELDS = ("world_size", "rank", "data_parallel_index", "data_parallel_size")


def worker_rank(parallel_config: Any) -> tuple[int, int]:
    """(this worker's rank among the engine's workers, the engine's worker count), DP included;
    :class:`UnplannableConfigError` if a field it needs is not an int (a mocked config)."""
    values: dict[str, Any] = {f: getattr(parallel_config, f, None) for f in PARALLEL_FIELDS}
    wrong = [f"parallel_config.{f} is {type(v).__name__}" for f, v in values.items() if type(v) is not int]
    if wrong:
        raise UnplannableConfigError(f"refit cannot plan from this vLLM parallel config: {', '.join(wrong)}, "
                                     "not an int (refit places each worker by its rank among the engine's workers)")
    per_replica, rank, replica, replicas = (values[f] for f in PARALLEL_FIELDS)
    return replica * per_replica + rank, per_replica * replicas


class RefitWeightTransferEngine(WeightTransferEngine[RefitWeightTransferInitInfo, RefitWeightTransferUpdateInfo]):
    """A refit receiver inside one vLLM worker."""

    init_info_cls = RefitWeightTransferInitInfo
    update_info_cls = RefitWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: RefitReceiver | None = None
        self.version: int | None = None
        self.last_stats: dict[str, Any] = {}
        self.catalog: dict[str, TensorSpec] | None = None
        """The HF tensors a step moves into this engine (read at the first step that names tensors)."""

    def parse_init_info(self, init_dict: dict[str, Any]) -> RefitWeightTransferInitInfo:
        """vLLM's parsing; init info it refuses is also reported to the trainers at its rendezvous (if it
        names one), so that they fail with its text instead of waiting for this worker."""
        try:
            return super().parse_init_info(init_dict)
        except Exception as exc:
            rendezvous = init_dict.get("rendezvous") if isinstance(init_dict, dict) else None
            if isinstance(rendezvous, str) and rendezvous:
                self._refuse(exc, rendezvous, init_dict.get("world_size"), init_dict.get("rank_offset"),
                             init_dict.get("options"))
            raise

    def init_transfer_engine(self, init_info: RefitWeightTransferInitInfo) -> None:
        self.shutdown()
        try:
            rank, workers = worker_rank(self.parallel_config)
            attach(self.model, self.vllm_config, loader=init_info.loader)
            target = self.model if init_info.lora is None else AdapterTarget(self.model, lora_spec(init_info.lora))
            receiver = RefitReceiver(target, rendezvous=init_info.rendezvous,
                                     rank=init_info.rank_offset + rank, world_size=init_info.world_size or workers,
                                     options=RefitOptions(**init_info.options))
            plannable(self.model_config)
        except Exception as exc:  # before setup: the trainers would only see their deadline pass
            self._refuse(exc, init_info.rendezvous, init_info.world_size, init_info.rank_offset, init_info.options)
            raise
        try:
            receiver.setup()
        except RefitError as exc:
            if NEVER_PLANNED in str(exc):
                exc.add_note("refit: train rank 0 plans once all the train ranks of its "
                             "RefitTrainerInitInfo.world_size have joined; world_size counts train ranks only "
                             "(vLLM's nccl backend counts the workers too)")
            raise
        self.receiver = receiver
        self.catalog = None

    def _refuse(self, error: Exception, rendezvous: str, world_size: Any, rank_offset: Any, options: Any) -> None:
        from .refusal import refuse_before_setup

        refuse_before_setup(error, self.parallel_config, rendezvous, world_size, rank_offset, options)

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise RefitError("refit weight transfer is not initialized: call init_weight_transfer_engine first")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator, which CPU engines do not have; refit's
        # receive returns only after every byte landed and was processed.
        try:
            parsed = self.parse_update_info(update_info)
        except Exception as exc:  # the trainers are in the step already: fail it on every rank
            if self.receiver is not None:
                self._refuse_step(exc)
            raise
        self.receive_weights(parsed)

    def receive_weights(self, update_info: RefitWeightTransferUpdateInfo) -> None:
        if self.receiver is None:
            raise RefitError("refit weight transfer is not initialized: call init_weight_transfer_engine first")
        only = None
        if update_info.tensors is not None or update_info.only is not None:
            try:
                only = self._subset(update_info)
            except Exception as exc:
                self._refuse_step(exc)
                raise
        self.version, self.last_stats = receive_step(self.receiver, self.model, update_info.version, only)

    def _subset(self, update_info: RefitWeightTransferUpdateInfo) -> frozenset[str] | None:
        """The tensors this step names, checked (None: every tensor). An adapter moves whole."""
        assert self.receiver is not None
        target = self.receiver.model
        if self.catalog is None:
            from .checkpoint import step_catalog

            self.catalog = target.catalog() if isinstance(target, AdapterTarget) else step_catalog(self.model_config)
        if isinstance(target, AdapterTarget):
            if step_names(update_info.tensors, update_info.only, self.catalog) is not None:
                raise InvalidRequestError("update_info names a subset of a LoRA adapter's tensors: an adapter "
                                          "moves whole every step")
            return None
        return step_subset(self.model, self.catalog, update_info.tensors, update_info.only)

    def _refuse_step(self, error: Exception) -> None:
        assert self.receiver is not None
        refuse_step(self.receiver, self.model, error)

    def finish_weight_update(self) -> None:
        """Nothing left: the step finished inside ``update_weights`` (vLLM publishes the version)."""

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def step_subset(model: torch.nn.Module, catalog: dict[str, TensorSpec], tensors: tuple[NamedTensor, ...] | None,
                only: list[str] | None) -> frozenset[str] | None:
    """The tensors a step names (``update_info``'s claims and ``only``), checked against the engine's
    ``catalog`` (None: every tensor); a subset is also held against what vLLM post-processes whole, and
    told to the model's state (its reload post-processes only the modules the subset writes)."""
    names = step_names(tensors, only, catalog)
    if names is not None:
        from refit_core import get_plugin_manager

        from .plugin import model_plan

        state = state_of(model)
        if state is None:
            raise RefitError("refit_vllm: a subset step on a model no refit session attached")
        plan = model_plan(model, state)
        check_subset(names, plan, get_plugin_manager().expert_name, reload=state.mode != "direct")
        state.subset = names
    return names


def refuse_step(receiver: RefitReceiver, model: torch.nn.Module, error: Exception) -> None:
    """Fail the step the trainers are sending with ``error`` before any byte lands (every rank hears
    it at once, as of any failed step); the engine keeps its weights."""
    refuse_next_step(model, error)
    try:
        receive_step(receiver, model)
    except Exception as exc:  # noqa: BLE001 - ``error`` is what the caller raises
        log.debug("refit: the refused step failed as planned: %s", exc)


def receive_step(receiver: RefitReceiver, model: torch.nn.Module, expected: int | None = None,
                 only: frozenset[str] | None = None) -> tuple[int | None, dict[str, Any]]:
    """One refit step into ``model`` (``only``: of those HF tensors; None: all) -> (version, stats);
    on failure the core calls
    ``refit_abort_update`` and the engine keeps its old weights where it can. Either way, every
    worker then agrees whether the engine may serve (:mod:`.serving`): where a rank needs a refit or
    the ranks' versions differ, the model refuses to serve on every worker until a step lands on
    every rank. The engine's error (:class:`~refit_vllm.serving.EngineRefusesError`, or the step's
    own) is raised by its last worker only (see :class:`~refit_vllm.serving.StepOutcome`); the
    others log theirs and return the version they hold, with no stats."""
    from .serving import after_step

    try:
        result = receiver.receive(only=only)
    except Exception as exc:
        outcome = after_step(receiver, model, failed=True)
        if outcome.reports:
            raise outcome.error(exc) from exc  # type: ignore[misc]  # never None with an error of its own
        log.error("refit: the step failed on gen rank %d (the engine's last worker reports it): %s",
                  receiver.rank, exc)
        return receiver.version, {}
    outcome = after_step(receiver, model, failed=False)
    version = result.version
    error = outcome.error(None) or (
        RefitError(f"refit received weight version {version}, but update_weights asked for {expected}")
        if expected is not None and version != expected else None)
    if error is not None and outcome.reports:
        raise error
    return version, {} if error is not None else {"version": version, "bytes": result.bytes,
                                                   "seconds": result.seconds}


# -- trainer side ---------------------------------------------------------------------------


@dataclass
class RefitTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``refit`` backend (``rank`` is this trainer's rank).

    ``rendezvous``: ``host:port`` of the refit store, hosted by train rank 0. ``world_size``: train
    ranks. ``gen_world_size``: gen ranks (vLLM workers of all engines; default: the engine's own).
    ``options`` / ``loader`` / ``lora``: see :class:`RefitWeightTransferInitInfo`; ``options`` apply to
    both sides.
    """

    backend: ClassVar[str] = vllm_plugin.BACKEND

    rendezvous: str = ""
    world_size: int = 1
    gen_world_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    loader: list[str] = field(default_factory=list)
    lora: dict[str, Any] | str | None = None

    def worker_info(self) -> RefitWeightTransferInitInfo:
        return RefitWeightTransferInitInfo(rendezvous=self.rendezvous, world_size=self.gen_world_size,
                                           options=dict(self.options), loader=list(self.loader), lora=self.lora)


class RefitSource(WeightSource):
    """A training model as a vLLM ``WeightSource``, on vLLM 0.32 and 0.33 alike.

    refit's own engine reads the model's shards in place and never iterates a source. For other
    consumers the source declares every parameter (global shape, every rank an owner) and yields
    full tensors, gathering a sharded parameter with ``full_tensor()`` (a collective among its
    ranks) -- ``__iter__`` on 0.32, ``iter_full()`` on 0.33.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def _param_metas(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    metadata = metadata_member(_param_metas)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, materialize_full_tensor(param)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.iter_full()


class SourceKind(Enum):
    """How refit reads a trainer's weights."""

    SHARDS = "every train rank's shards, in place"
    """A module (``RefitSource``, vLLM's ``ModuleSource`` or the module itself): every train rank is a
    refit sender of its own shards."""
    ONE_RANK = "train rank 0's full tensors, from the source's iteration"
    """Any other ``WeightSource``: train rank 0 is the refit's only sender (:mod:`.held`); the other
    ranks only join the source's iteration (its collectives), as with vLLM's ``nccl`` backend."""


def _train_module(source: WeightSource | torch.nn.Module | None) -> torch.nn.Module | None:
    """The training module refit reads in place, or None for a source it plans from metadata."""
    if source is None:
        raise InvalidRequestError("refit trainer weight transfer requires a WeightSource: pass "
                                  "source=RefitSource(model) (or a vLLM ModuleSource, the module itself, or any "
                                  "WeightSource whose rank 0 yields full tensors)")
    if isinstance(source, torch.nn.Module):
        return source
    if isinstance(source, RefitSource):
        return source.model
    if isinstance(source, ModuleSource):
        return source._module
    if not isinstance(source, WeightSource):
        raise InvalidRequestError(f"source is a {type(source).__name__}, not a vLLM WeightSource or a torch module")
    return None


def _held_weights(source: WeightSource) -> HeldWeights:
    """Train rank 0's buffers for a one-rank ``source``, on this rank's accelerator (else the CPU)."""
    elsewhere = not_on_rank_0(source)
    if elsewhere:
        raise InvalidRequestError(f"refit sends a WeightSource from train rank 0 alone, but rank 0 does not own "
                                  f"{len(elsewhere)} of its parameters (first: {elsewhere[0]})")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    declared = [Declared(m.name, m.dtype, tuple(m.shape)) for m in source_metadata(source)]
    return HeldWeights(declared, device)


MISSING_TRAIN_RANKS = re.compile(r"waiting for train metadata: (.*?)( \.\.\.)? did not arrive")


def _setup(sender: RefitSender, world_size: int) -> None:
    """``sender.setup()``; a deadline passed waiting for train ranks that never came is named as a
    wrong ``world_size`` (what vLLM's ``nccl`` users pass: trainer plus workers)."""
    try:
        sender.setup()
    except RefitError as exc:
        found = MISSING_TRAIN_RANKS.search(str(exc))
        if found is None:
            raise
        missing = found.group(1).count("train rank")
        arrived = f"at most {world_size - missing}" if found.group(2) else f"{world_size - missing}"
        raise RefitError(f"expected {world_size} train ranks, {arrived} arrived; world_size counts train ranks "
                         f"only (vLLM's nccl backend counts the trainer and the workers): {exc}") from exc


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """A refit sender on every train rank (one-rank sources: on rank 0 only, see :class:`SourceKind`);
    rank 0 also drives the engine through ``client``."""

    init_info_cls = RefitTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, sender: RefitSender | None = None, rank: int = 0,
                 kind: SourceKind = SourceKind.SHARDS, held: HeldWeights | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank = rank  # vLLM 0.33's base class keeps it too; 0.32's does not take it
        self.sender = sender
        self.kind = kind
        self.held = held
        """Train rank 0's copy of a one-rank source's tensors (None elsewhere and for a module source)."""
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        """Join the refit. With a module source every train rank is a refit sender of its shards and
        returns once setup (metadata exchange and planning, a collective of both sides) is done. With
        any other ``WeightSource`` only rank 0 joins: the other ranks return at once, as with vLLM's
        ``nccl`` backend, and only join the source's iteration in ``send_weights``."""
        if not init_info.rendezvous:
            raise InvalidRequestError("RefitTrainerInitInfo.rendezvous must be 'host:port' (train rank 0 hosts it)")
        module = _train_module(source)
        options = RefitOptions(**init_info.options)
        if module is None:
            assert isinstance(source, WeightSource)
            if not init_info.is_sender:
                return cls(client=client, source=source, is_sender=False, rank=init_info.rank,
                           kind=SourceKind.ONE_RANK)
            held = _held_weights(source)
            sender = RefitSender(held, rendezvous=init_info.rendezvous, rank=0, world_size=1, options=options)
            engine = cls(client=client, source=source, sender=sender, rank=init_info.rank, kind=SourceKind.ONE_RANK,
                         held=held)
            world_size = 1
        else:
            sender = RefitSender(module, rendezvous=init_info.rendezvous, rank=init_info.rank,
                                 world_size=init_info.world_size, options=options)
            engine = cls(client=client, source=source if isinstance(source, WeightSource) else RefitSource(module),
                         is_sender=init_info.is_sender, sender=sender, rank=init_info.rank)
            world_size = init_info.world_size
            if not engine.is_sender:
                _setup(sender, world_size)
                return engine
        payload = asdict(init_info.worker_info())
        _concurrently(lambda: client.init_weight_transfer_engine(payload), lambda: _setup(sender, world_size))
        return engine

    def send_weights(self, version: int | None = None, names: list[str] | None = None) -> int:
        """Send the model's current weights as ``version`` (default: the previous one plus 1).

        Called on every train rank (all with the same version and ``names``). ``names``: the HF
        tensors this step moves (None: all of them); the engine's others keep their bytes, and the
        version advances all the same. Rank 0 drives the engine: ``start_weight_update``,
        ``update_weights({"version": version, "only": names})`` (concurrently with the transfer) and
        ``finish_weight_update(weight_version=str(version))``. A one-rank source is iterated on every
        rank first (its collectives), rank 0 keeping what it yields.
        """
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
            raise InvalidRequestError("send_weights names must be a list of HF tensor names")
        only = None if names is None else list(names)
        self.version = self.version + 1 if version is None else int(version)
        if self.kind is SourceKind.ONE_RANK:
            assert self.source is not None
            tensors = full_tensors(self.source)
            if self.held is not None:
                self.held.fill(tensors)
            else:
                for _ in tensors:
                    pass
        if not self.is_sender:
            if self.sender is not None:
                self.sender.send(version=self.version, only=only)
            return self.version
        sender = self.sender
        if sender is None:
            raise RefitError("refit trainer weight transfer is shut down")
        self.client.start_weight_update()
        info: dict[str, Any] = {"version": self.version} if only is None else {"version": self.version, "only": only}
        _concurrently(lambda: self.client.update_weights(info), lambda: sender.send(version=self.version, only=only))
        self.client.finish_weight_update(weight_version=str(self.version))
        return self.version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


REMOTE_GRACE_S = 2.0
"""How long a failed local half waits for the engine's reply, for its error text."""


def _concurrently(remote: Any, local: Any) -> None:
    """Run the engine-side call on a thread while this rank runs its half of the collective.

    If the local half fails, the remote call is awaited for :data:`REMOTE_GRACE_S` at most (it may be
    blocked on a peer that will never come); the remote error, if it failed by then (an engine that
    refused the step names why), is added to the local one as a note. If the remote call fails
    first, its error is raised once the local half returns or fails (an engine that refuses before
    its setup tells the local half through refit's rendezvous: :mod:`.refusal`).
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-vllm-client")
    future: Future = pool.submit(remote)
    try:
        local()
    except BaseException as exc:
        try:
            remote_error = future.exception(timeout=REMOTE_GRACE_S)
        except FutureTimeout:
            remote_error = None
        if remote_error is not None:
            exc.add_note(f"refit: the engine side failed too: {type(remote_error).__name__}: {remote_error}")
        raise
    finally:
        pool.shutdown(wait=False)
    future.result()


vllm_plugin.register()

__all__ = [
    "RefitSource", "RefitTrainerInitInfo", "RefitTrainerWeightTransferEngine", "RefitWeightTransferEngine",
    "RefitWeightTransferInitInfo", "RefitWeightTransferUpdateInfo", "SourceKind", "receive_step",
]
