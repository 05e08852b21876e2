"""The trainer side of the ``refit`` vLLM weight-transfer backend: one sender per train rank.

``WeightTransferTrainerFactory.trainer_init(RefitTrainerInitInfo(...), client=..., source=...)``: every train
rank owns a :class:`refit_core.RefitSender`; rank 0 also drives the engine through the client
(``VLLMWeightSyncClient``: the four calls of :mod:`refit_vllm.worker_transfer`), concurrently with its own
collectives.
"""


from __future__ import annotations

import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)

from refit_core import RefitError, RefitOptions, RefitSender

from . import vllm_plugin
from .compat import full_tensors, metadata_member, not_on_rank_0, source_metadata
from .held import Declared, HeldWeights
from .refusal import publish_client_error
from .requests import InvalidRequestError
from .worker_transfer import RefitWeightTransferInitInfo

log = logging.getLogger("refit.vllm")


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


def _engine_options(sender: RefitSender, options: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The engine's ``options``, with train rank 0's secret: its own (given, ``REFIT_SECRET`` or torchrun's),
    or, where it is the only train rank and none was given, a fresh one, made here. The secret reaches the
    engine over the drop-in's own control channel (the one that already drives the engine), never the
    rendezvous; with ``insecure`` and no secret, none is made."""
    mine = sender.options
    if mine.secret is None and not mine.insecure and world_size == 1:
        sender.options = mine = mine.overridden({"secret": secrets.token_hex(16)}, explicit=False)  # `refit secret`'s
    return options if mine.secret is None else {**options, "secret": mine.secret}


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
        payload["options"] = _engine_options(sender, payload["options"], world_size)
        _concurrently(lambda: client.init_weight_transfer_engine(payload), lambda: _setup(sender, world_size),
                      on_remote_error=lambda exc: publish_client_error(exc, rendezvous=payload["rendezvous"],
                                                                       options=payload["options"]))
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

        def engine_failed(exc: Exception) -> None:  # every rank of the step stops now, hearing the engine's error
            sender.abort(f"the vLLM engine's update_weights raised (train rank 0's client): "
                         f"{type(exc).__name__}: {exc}")

        _concurrently(lambda: self.client.update_weights(info), lambda: sender.send(version=self.version, only=only),
                      on_remote_error=engine_failed)
        self.client.finish_weight_update(weight_version=str(self.version))
        return self.version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


REMOTE_GRACE_S = 2.0
"""How long a failed local half waits for the engine's reply, for its error text."""


def _concurrently(remote: Callable[[], None], local: Callable[[], None], *,
                  on_remote_error: Callable[[Exception], None] | None = None) -> None:
    """Run the engine-side call on a thread while this rank runs its half of the collective.

    If the remote call raises while the local half still runs, ``on_remote_error`` gets its error on that
    thread (at init: :func:`.refusal.publish_client_error` tells every rank of the refit at once, whose
    setup would otherwise wait for gen ranks that never come, until its deadline and then some). If the
    local half fails, the remote call's answer is awaited for :data:`REMOTE_GRACE_S` at most (it may be
    blocked on a peer that will never come); the local error is raised, caused by the remote one if it
    failed by then (an engine that refused the step names why), whose text is added as a note unless the
    local error already carries it. If the remote call fails first, its error is raised once the local
    half returns or fails (an engine that refuses before its setup tells the local half through refit's
    rendezvous: :mod:`.refusal`).
    """
    answer: Future = Future()  # the remote call's own outcome, before ``on_remote_error`` runs
    local_done = threading.Event()

    def call_remote() -> None:
        try:
            remote()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread, through ``answer``
            answer.set_exception(exc)
            if on_remote_error is not None and isinstance(exc, Exception) and not local_done.is_set():
                on_remote_error(exc)
        else:
            answer.set_result(None)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-vllm-client")
    pool.submit(call_remote)
    try:
        local()
    except BaseException as exc:
        local_done.set()
        try:
            remote_error = answer.exception(timeout=REMOTE_GRACE_S)
        except FutureTimeout:
            remote_error = None
        if remote_error is None:
            raise
        if str(remote_error) not in str(exc):
            exc.add_note(f"refit: the engine side failed too: {type(remote_error).__name__}: {remote_error}")
        if exc.__cause__ is None:
            raise exc from remote_error
        raise
    finally:
        local_done.set()
        pool.shutdown(wait=False)
    answer.result()
