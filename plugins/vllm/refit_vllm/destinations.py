"""The vLLM side of destination planning: which quantization methods keep checkpoint values as loaded.

:func:`model_plan` plans a live model once per session and picks its update mode. The planning itself
(fast-path pieces, loader-path closure over fused groups, grouped experts) is the
core's :mod:`refit_core.kit.loadplan`, shared with the SGLang plugin; the trace is vLLM's
(:mod:`refit_vllm.probe`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from refit_core import ExpertName, RefitError, TensorSpec, get_plugin_manager
from refit_core.kit import ModelPlan, PlannedPiece
from refit_core.kit import plan_model as _plan_with

from .checkpoint import engine_checkpoint_specs
from .probe import trace_loads
from .reload import direct_capable
from .state import MODE_ENV, ModelState, engine_context, read_setting

log = logging.getLogger("refit.vllm")

FAST_QUANT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                                "UnquantizedFusedMoEMethod"})
"""Quantization methods whose parameters hold checkpoint values as loaded (before post-processing)."""

__all__ = ["FAST_QUANT_METHODS", "ModelPlan", "PlannedPiece", "model_plan", "plan_model"]


def plan_model(model: torch.nn.Module, specs: list[TensorSpec], *,
               namer: Callable[[str], ExpertName | None],
               loader_patterns: Iterable[str] = ()) -> ModelPlan:
    """Trace ``model``'s vLLM loaders for ``specs`` (HF tensors, per-expert names) and split fast / loader."""
    return _plan_with(model, specs, namer=namer, tracer=trace_loads, fast_quant_methods=FAST_QUANT_METHODS,
                      loader_patterns=loader_patterns)


def model_plan(model: torch.nn.Module, state: ModelState) -> ModelPlan:
    """The destination plan of ``model`` (traced once per session); ``state.mode`` is set with it."""
    if state.plan is None:
        with engine_context(state):
            specs = engine_checkpoint_specs(state.model_config)
            plan = plan_model(model, specs, namer=get_plugin_manager().expert_name,
                              loader_patterns=state.loader_patterns)
        mode = read_setting(MODE_ENV) or "auto"
        if mode not in ("auto", "reload", "direct"):
            raise RefitError(f"{MODE_ENV}={mode!r}: use auto, reload or direct")
        capable = direct_capable(model, plan)
        if mode == "direct" and not capable:
            raise RefitError(f"{MODE_ENV}=direct, but this model needs vLLM's post-load processing "
                             "(CPU, quantized or re-laid-out layers, or a loader path)")
        state.mode = "direct" if capable and mode != "reload" else "reload"
        state.plan = plan
        log.info("refit: vLLM destination plan (%s mode): %s", state.mode, plan.summary())
        for module, why in sorted(plan.loader_reasons.items()):
            log.info("refit: loader path for %s (%s)", module, why)
    return state.plan
