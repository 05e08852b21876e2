"""The vLLM side of destination planning: which quantization methods keep checkpoint values as loaded.

The planning itself (fast-path pieces, loader-path closure over fused groups, grouped experts) is the
core's :mod:`refit_core.kit.loadplan`, shared with the SGLang plugin; the trace is vLLM's
(:mod:`refit_vllm.probe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from refit_core import ExpertName, TensorSpec
from refit_core.kit import ModelPlan, PlannedPiece
from refit_core.kit import plan_model as _plan_with

from .probe import trace_loads

FAST_QUANT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                                "UnquantizedFusedMoEMethod"})
"""Quantization methods whose parameters hold checkpoint values as loaded (before post-processing)."""

__all__ = ["FAST_QUANT_METHODS", "ModelPlan", "PlannedPiece", "plan_model"]


def plan_model(model: torch.nn.Module, specs: list[TensorSpec], *,
               namer: Callable[[str], ExpertName | None],
               loader_patterns: Iterable[str] = ()) -> ModelPlan:
    """Trace ``model``'s vLLM loaders for ``specs`` (HF tensors, per-expert names) and split fast / loader."""
    return _plan_with(model, specs, namer=namer, tracer=trace_loads, fast_quant_methods=FAST_QUANT_METHODS,
                      loader_patterns=loader_patterns)
