"""The ``refit`` backend of vLLM's weight-transfer API, worker side and trainer side.

Worker side (``LLM(..., weight_transfer_config=WeightTransferConfig(backend="refit"))``): each vLLM
worker owns one :class:`RefitWeightTransferEngine`, which owns one :class:`refit_core.RefitReceiver`
(gen rank = the worker's rank among all workers of all engines in the refit). vLLM's own calls drive
it:

- ``init_weight_transfer_engine({"rendezvous": "host:port", ...})``: setup (metadata exchange,
  planning; a mismatched model fails here, before anything is touched);
- ``start_weight_update()``: nothing to do (refit opens vLLM's layerwise reload itself, in step);
- ``update_weights({"version": k})``: receive one step: reload opened, bytes written into the fused
  parameters, loader path, post-processing -- or, on failure, the previous weights restored;
- ``finish_weight_update(weight_version="k")``: vLLM publishes the version to request outputs.

Trainer side (``WeightTransferTrainerFactory.trainer_init(RefitTrainerInitInfo(...), client=...,
source=...)``): every train rank owns a :class:`refit_core.RefitSender`; rank 0 also drives the
engine through the client (``VLLMWeightSyncClient``: the four calls above), concurrently with its
own collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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

from refit_core import RefitError, RefitOptions, RefitReceiver, RefitSender

from . import vllm_plugin
from .compat import metadata_member
from .state import attach

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
    names forced onto the loader path.
    """

    rendezvous: str
    world_size: int | None = None
    rank_offset: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    loader: list[str] = field(default_factory=list)


@dataclass
class RefitWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One step. ``version``, when given, must equal the version the train side sends."""

    version: int | None = None


def worker_rank(parallel_config: Any) -> tuple[int, int]:
    """(this worker's rank among the engine's workers, the engine's worker count), DP included."""
    per_replica = parallel_config.world_size
    rank = parallel_config.data_parallel_index * per_replica + parallel_config.rank
    return rank, per_replica * parallel_config.data_parallel_size


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
            receiver = RefitReceiver(self.model, rendezvous=init_info.rendezvous,
                                     rank=init_info.rank_offset + rank, world_size=init_info.world_size or workers,
                                     options=RefitOptions(**init_info.options))
        except Exception as exc:  # before setup: the trainers would only see their deadline pass
            self._refuse(exc, init_info.rendezvous, init_info.world_size, init_info.rank_offset, init_info.options)
            raise
        receiver.setup()
        self.receiver = receiver

    def _refuse(self, error: Exception, rendezvous: str, world_size: Any, rank_offset: Any, options: Any) -> None:
        from .refusal import refuse_before_setup

        refuse_before_setup(error, self.parallel_config, rendezvous, world_size, rank_offset, options)

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise RefitError("refit weight transfer is not initialized: call init_weight_transfer_engine first")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator, which CPU engines do not have; refit's
        # receive returns only after every byte landed and was processed.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RefitWeightTransferUpdateInfo) -> None:
        if self.receiver is None:
            raise RefitError("refit weight transfer is not initialized: call init_weight_transfer_engine first")
        self.version, self.last_stats = receive_step(self.receiver, self.model, update_info.version)

    def finish_weight_update(self) -> None:
        """Nothing left: the step finished inside ``update_weights`` (vLLM publishes the version)."""

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def receive_step(receiver: RefitReceiver, model: torch.nn.Module,
                 expected: int | None = None) -> tuple[int | None, dict[str, Any]]:
    """One refit step into ``model`` -> (version, stats); on failure the core calls
    ``refit_abort_update`` and the engine keeps its old weights where it can. Either way, every
    worker then agrees whether the engine may serve (:mod:`.serving`): where a rank needs a refit or
    the ranks' versions differ, the model refuses to serve on every worker until a step lands on
    every rank. The engine's error (:class:`~refit_vllm.serving.EngineRefusesError`, or the step's
    own) is raised by its last worker only (see :class:`~refit_vllm.serving.StepOutcome`); the
    others log theirs and return the version they hold, with no stats."""
    from .serving import after_step

    try:
        result = receiver.receive()
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
    ``options`` / ``loader``: see :class:`RefitWeightTransferInitInfo`; ``options`` apply to both
    sides.
    """

    backend: ClassVar[str] = vllm_plugin.BACKEND

    rendezvous: str = ""
    world_size: int = 1
    gen_world_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    loader: list[str] = field(default_factory=list)

    def worker_info(self) -> RefitWeightTransferInitInfo:
        return RefitWeightTransferInitInfo(rendezvous=self.rendezvous, world_size=self.gen_world_size,
                                           options=dict(self.options), loader=list(self.loader))


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


def _train_model(source: WeightSource | torch.nn.Module | None) -> torch.nn.Module:
    if isinstance(source, torch.nn.Module):
        return source
    if isinstance(source, RefitSource):
        return source.model
    if isinstance(source, ModuleSource):
        return source._module
    raise RefitError("the refit trainer engine reads the training model's shards in place: pass "
                     "source=RefitSource(model) (or a vLLM ModuleSource, or the module itself)")


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """A refit sender on every train rank; rank 0 also drives the engine through ``client``."""

    init_info_cls = RefitTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, sender: RefitSender | None = None, rank: int = 0) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank = rank  # vLLM 0.33's base class keeps it too; 0.32's does not take it
        self.sender = sender
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if not init_info.rendezvous:
            raise RefitError("RefitTrainerInitInfo.rendezvous must be 'host:port' (train rank 0 hosts it)")
        model = _train_model(source)
        sender = RefitSender(model, rendezvous=init_info.rendezvous, rank=init_info.rank,
                             world_size=init_info.world_size, options=RefitOptions(**init_info.options))
        engine = cls(client=client, source=source if isinstance(source, WeightSource) else RefitSource(model),
                     is_sender=init_info.is_sender, sender=sender, rank=init_info.rank)
        if not engine.is_sender:
            sender.setup()
            return engine
        payload = asdict(init_info.worker_info())
        _concurrently(lambda: client.init_weight_transfer_engine(payload), sender.setup)
        return engine

    def send_weights(self, version: int | None = None) -> int:
        """Send the model's current weights as ``version`` (default: the previous one plus 1).

        Called on every train rank (all with the same version). Rank 0 drives the engine:
        ``start_weight_update``, ``update_weights`` (concurrently with the transfer) and
        ``finish_weight_update(weight_version=str(version))``.
        """
        assert self.sender is not None
        self.version = self.version + 1 if version is None else int(version)
        if not self.is_sender:
            self.sender.send(version=self.version)
            return self.version
        self.client.start_weight_update()
        _concurrently(lambda: self.client.update_weights({"version": self.version}),
                      lambda: self.sender.send(version=self.version))
        self.client.finish_weight_update(weight_version=str(self.version))
        return self.version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _concurrently(remote: Any, local: Any) -> None:
    """Run the engine-side call on a thread while this rank runs its half of the collective.

    If the local half fails, the remote call is not awaited (it may be blocked on a peer that will
    never come); the remote error, if it already failed, is added to the local one as a note. If the
    remote call fails first, its error is raised once the local half returns or fails (an engine
    that refuses before its setup tells the local half through refit's rendezvous: :mod:`.refusal`).
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-vllm-client")
    future: Future = pool.submit(remote)
    try:
        local()
    except BaseException as exc:
        remote_error = future.exception() if future.done() else None
        if remote_error is not None:
            exc.add_note(f"refit: the engine side failed too: {type(remote_error).__name__}: {remote_error}")
        raise
    finally:
        pool.shutdown(wait=False)
    future.result()


vllm_plugin.register()

__all__ = [
    "RefitSource", "RefitTrainerInitInfo", "RefitTrainerWeightTransferEngine", "RefitWeightTransferEngine",
    "RefitWeightTransferInitInfo", "RefitWeightTransferUpdateInfo", "receive_step",
]
