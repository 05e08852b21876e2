"""refit's hooks for vLLM (entry point ``refit: vllm``).

The hooks select themselves only for models built by vLLM (the ``nn.Module`` under a worker's model
runner) and for the backend name ``"vllm"``. Importing this module does not import vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from refit_core import (
    Backend,
    DestinationMap,
    DestinationPiece,
    LoraSpec,
    ParallelLayout,
    RefitError,
    Side,
    SourcePiece,
    hookimpl,
)
from refit_core.apps import DemoPrograms
from refit_core.kit import refuse_serving, resume_serving

from . import reload
from .destinations import ModelPlan, model_plan
from .held import HeldWeights
from .layout import destination_layout
from .lora_layout import adapter_destination_layout
from .probe import quiet_loads
from .reload import live_tensor
from .state import engine_context, model_device, state_of

if TYPE_CHECKING:
    from refit_core.apps import DemoContext, DemoReport

log = logging.getLogger("refit.vllm")


def _demo_gen(ctx: DemoContext) -> DemoReport:
    from .demo import demo_gen

    return demo_gen(ctx)


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend("vllm", {Side.GEN}, "a running vLLM engine: fused qkv/gate_up/w13 written in place, "
                     "vLLM's layerwise reload, loader path for the rest"))


@hookimpl
def refit_register_demos(register: Callable[[DemoPrograms], None]) -> None:
    register(DemoPrograms("vllm", gen=_demo_gen, priority=20, rl_gen_actor="refit_vllm.ray:VLLMEngineActor"))


def _views(model: torch.nn.Module, plan: ModelPlan, live: bool) -> list[torch.Tensor]:
    """Views of engine memory for every piece; zero-size placeholders when memory is not there yet.

    Outside an update in reload mode the checkpoint-format tensors do not exist (vLLM keeps only its
    kernel format); the placeholders carry shape, dtype and device, and cannot be written to.
    """
    if not live:
        device = model_device(model)
        return [torch.empty((), dtype=p.spec.dtype, device=device).expand(p.box.sizes) for p in plan.pieces]
    views = []
    for piece in plan.pieces:
        tensor = live_tensor(model, piece.target)
        target = plan.targets[piece.target]
        if (tensor is None or tensor.is_meta or tuple(tensor.shape) != target.shape
                or tuple(tensor.stride()) != target.stride or tensor.dtype != target.dtype):
            raise RefitError(f"vLLM tensor {'.'.join(piece.target)} is not in the traced checkpoint format "
                             f"(expected {target.shape} {target.dtype}, found "
                             f"{None if tensor is None else (tuple(tensor.shape), tensor.dtype, tensor.device)})")
        views.append(tensor.detach().as_strided(piece.box.sizes, piece.strides,
                                                tensor.storage_offset() + piece.offset))
    return views


@hookimpl
def refit_destination_map(model: Any) -> DestinationMap | None:
    state = state_of(model)
    if state is None:
        return None
    plan = model_plan(model, state)
    views = _views(model, plan, live=state.updating or state.mode == "direct")
    pieces = [DestinationPiece(p.spec, p.box, v) for p, v in zip(plan.pieces, views)]
    return DestinationMap(pieces=pieces, loader=list(plan.loader))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    """A one-rank ``WeightSource``'s held full tensors (:mod:`.held`)."""
    return model.pieces() if isinstance(model, HeldWeights) else None


@hookimpl
def refit_begin_update(model: Any) -> bool | None:
    state = state_of(model)
    if state is None:
        return None
    if state.refusal is not None:
        error, state.refusal = state.refusal, None
        raise error
    plan = model_plan(model, state)
    if state.mode == "direct":
        return False
    if state.updating:
        raise RefitError("refit_begin_update called twice without refit_finish_update")
    with engine_context(state):
        reload.begin(model, plan)
    state.updating = True
    return True


@hookimpl
def refit_load_weights(model: Any, weights: list[tuple[str, torch.Tensor]]) -> bool | None:
    state = state_of(model)
    if state is None:
        return None
    if not state.updating:
        raise RefitError("the vLLM loader path needs refit_begin_update first")
    with engine_context(state), quiet_loads(), torch.no_grad():
        model.load_weights(iter(weights))
    return True


@hookimpl
def refit_finish_update(model: Any, version: int) -> bool | None:
    state = state_of(model)
    if state is None:
        return None
    if state.updating:
        with engine_context(state):
            reload.finish(model, state.plan, state.model_config, subset=state.subset)
        state.updating = False
    state.subset = None
    state.version = version
    resume_serving(model)
    return True


@hookimpl
def refit_abort_update(model: Any, torn: list[str]) -> bool | None:
    """After a failed step: the reload path gives every layer its previous kernel tensors back (the
    step wrote only into re-materialized checkpoint-format copies); what cannot be restored -- direct
    writes into live tensors, and layers the engine's own loader already processed -- makes the
    model refuse to serve (its forward raises) until a refit succeeds. (An adapter's slots get their
    saved bytes back from the core's own hook: :class:`~refit_vllm.lora.AdapterTarget`.)"""
    state = state_of(model)
    if state is None:
        return None
    state.subset = None
    unrestorable = list(torn)
    if state.updating:
        with engine_context(state):
            reload.abort(model)
        state.updating = False
        loader = {spec.name for spec in state.plan.loader} if state.plan is not None else set()
        unrestorable = [name for name in torn if name in loader]
    if unrestorable:
        refuse_serving(model, unrestorable)
    return True


@hookimpl
def refit_destination_layout(backend: str, config: dict[str, Any], layout: ParallelLayout,
                             rank: int) -> DestinationMap | None:
    if backend != "vllm":
        return None
    return destination_layout(config, layout, rank)


@hookimpl
def refit_adapter_destination_layout(backend: str, config: dict[str, Any], layout: ParallelLayout, rank: int,
                                     lora: LoraSpec) -> DestinationMap | None:
    """vLLM's LoRA slots (``enable_lora``) as adapter mode writes them: :mod:`refit_vllm.lora_layout`."""
    if backend != "vllm":
        return None
    return adapter_destination_layout(config, lora, layout, rank)
