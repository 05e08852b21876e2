"""The worker side of the ``refit`` vLLM weight-transfer backend: one receiver per vLLM worker.

Each vLLM worker (``LLM(..., weight_transfer_config=WeightTransferConfig(backend="refit"))``) owns one
:class:`RefitWeightTransferEngine`, which owns one :class:`refit_core.RefitReceiver` (gen rank = the worker's
rank among all workers of all engines in the refit). vLLM's own calls drive it:

- ``init_weight_transfer_engine({"rendezvous": "host:port", ...})``: setup (metadata exchange,
  planning; a mismatched model fails here, before anything is touched);
- ``start_weight_update()``: nothing to do (refit opens vLLM's layerwise reload itself, in step);
- ``update_weights({"version": k})``: receive one step: reload opened, bytes written into the fused
  parameters, loader path, post-processing -- or, on failure, the previous weights restored; with
  ``names`` (vLLM's ``nccl`` update info) or ``only`` naming a subset, exactly those tensors;
- ``finish_weight_update(weight_version="k")``: vLLM publishes the version to request outputs.
"""


from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refit_core import RefitError, RefitOptions, RefitReceiver, TensorSpec, get_plugin_manager

from .checkpoint import plannable, step_catalog
from .destinations import model_plan
from .lora import AdapterTarget, lora_spec
from .refusal import refuse_before_setup
from .requests import InvalidRequestError, NamedTensor, check_subset, named_tensors, step_names
from .serving import after_step
from .state import attach, refuse_next_step, state_of, worker_rank

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
