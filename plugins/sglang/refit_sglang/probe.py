"""Where every HF tensor lands in an SGLang model, learned from SGLang's own ``load_weights``.

The tracing and planning are the core's (:mod:`refit_core.kit.loadtrace`, :mod:`refit_core.kit.loadplan`),
shared with the vLLM plugin. SGLang keeps unquantized parameters in checkpoint format (its
``begin_weight_update`` restores any in-place packing before weights load), so the traced stand-ins
are plain meta copies of the live tensors. What is SGLang's own here: which quantization methods keep
values as loaded, and how a planned piece becomes a view of live SGLang memory.
"""

from __future__ import annotations

import logging

import torch

from refit_core import RefitError, get_plugin_manager
from refit_core.kit import ModelPlan, PlannedPiece, plan_model, trace_loads

from .state import ModelState

log = logging.getLogger("refit.sglang")

FAST_QUANT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                                "UnquantizedFusedMoEMethod"})
"""SGLang quantization methods (``sglang.srt.layers.quantization.unquant``) whose parameters hold
checkpoint values exactly as ``load_weights`` wrote them."""


def planned(model: torch.nn.Module, state: ModelState) -> ModelPlan:
    """``model``'s destination plan (traced once, at the first ask)."""
    if state.plan is None:
        state.plan = plan_model(model, state.specs, namer=get_plugin_manager().expert_name, tracer=trace_loads,
                                fast_quant_methods=FAST_QUANT_METHODS, loader_patterns=state.loader)
        log.info("refit: SGLang destination plan: %s", state.plan.summary())
        for module, why in sorted(state.plan.loader_reasons.items()):
            log.info("refit: loader path for %s (%s)", module, why)
    return state.plan


def live_tensor(model: torch.nn.Module, key: tuple[str, str]) -> torch.Tensor:
    """The live parameter or buffer ``module.name`` of ``model``."""
    module, name = key
    return getattr(model.get_submodule(module), name)


def live_views(model: torch.nn.Module, plan: ModelPlan) -> list[torch.Tensor]:
    """A view of live SGLang memory for every planned piece, checked against the traced geometry."""
    return [_view(model, plan, piece) for piece in plan.pieces]


def _view(model: torch.nn.Module, plan: ModelPlan, piece: PlannedPiece) -> torch.Tensor:
    tensor = live_tensor(model, piece.target)
    target = plan.targets[piece.target]
    if (tensor.is_meta or tuple(tensor.shape) != target.shape or tuple(tensor.stride()) != target.stride
            or tensor.dtype != target.dtype):
        raise RefitError(f"SGLang tensor {'.'.join(piece.target)} is not in the traced checkpoint format "
                         f"(expected {target.shape} {target.dtype}, found {tuple(tensor.shape)} {tensor.dtype} "
                         f"on {tensor.device}); was it repacked outside begin_weight_update()?")
    return tensor.detach().as_strided(piece.box.sizes, piece.strides, tensor.storage_offset() + piece.offset)


def storages(model: torch.nn.Module, plan: ModelPlan) -> tuple[int, ...]:
    """Data pointers of every fast-path tensor: they change when SGLang re-materializes one."""
    return tuple(live_tensor(model, key).data_ptr() for key in sorted({p.target for p in plan.pieces}))


def write_padding(model: torch.nn.Module, plan: ModelPlan) -> None:
    """Zero what no loader writes (padding) and write the loaders' constant fills, as a fresh load does."""
    with torch.no_grad():
        for key in plan.zero:
            live_tensor(model, key).zero_()
        for fill in plan.fills:
            fill.dst_box.slice_of(live_tensor(model, fill.target).detach()).fill_(fill.value)
