"""Per-model state of the SGLang plugin: the checkpoint a model is refitted from, its plan, its version."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core import RefitError, TensorSpec
from refit_core.kit import ModelPlan

SGLANG_MODEL_PACKAGE = "sglang.srt.models."


@dataclass
class ModelState:
    """What the plugin knows about one live SGLang model (one TP rank's ``nn.Module``).

    ``specs``: the HF checkpoint tensors the model is refitted from (per-expert names); ``loader``:
    regular expressions of HF names forced onto the loader path; ``storages``: the data pointers
    of the fast-path tensors when their views were last handed out (a change means SGLang
    re-materialized them, so refit must ask for the views again); ``padded``: whether the padding
    SGLang's loaders write (zeroed vocabulary rows) is written in the current storages;
    ``version``: the last weight version that landed.
    """

    specs: list[TensorSpec]
    loader: tuple[str, ...] = ()
    plan: ModelPlan | None = None
    storages: tuple[int, ...] | None = None
    padded: bool = False
    updating: bool = False
    version: int | None = None


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, ModelState] = weakref.WeakKeyDictionary()


def is_sglang_model(model: Any) -> bool:
    """A model class of SGLang's ``sglang.srt.models`` with a ``load_weights`` -- never imports SGLang."""
    return ("sglang" in sys.modules and isinstance(model, torch.nn.Module)
            and type(model).__module__.startswith(SGLANG_MODEL_PACKAGE)
            and callable(getattr(model, "load_weights", None)))


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating-point dtype SGLang keeps the model's weights in (what refit sends them as)."""
    for param in model.parameters():
        if param.dtype.is_floating_point and param.element_size() > 1:  # not a quantized (FP8) weight
            return param.dtype
    return torch.get_default_dtype()


def config_specs(model: torch.nn.Module) -> list[TensorSpec]:
    """The HF tensors of ``model``'s config (per-expert names), floating ones in the model's dtype
    (those a block-FP8 model holds quantized as FP8 with their scales, :mod:`refit_sglang.fp8`)."""
    from refit_core.kit import checkpoint_specs

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise RefitError(f"SGLang model {type(model).__name__} has no HF config: call "
                         "refit_sglang.attach(model, specs=...) with its checkpoint tensors")
    try:
        specs = checkpoint_specs(config.to_dict(), grouped=False)
    except RefitError as exc:
        raise RefitError(f"cannot list the HF tensors of SGLang model {type(model).__name__}: {exc}; "
                         "call refit_sglang.attach(model, specs=...) with its checkpoint tensors") from exc
    dtype = model_dtype(model)
    specs = [TensorSpec(s.name, s.shape, dtype if s.dtype.is_floating_point else s.dtype) for s in specs]
    from .fp8 import block_fp8_specs, holds_fp8

    return block_fp8_specs(model, specs) if holds_fp8(model) else specs


def attach(model: torch.nn.Module, *, specs: Sequence[TensorSpec] | None = None,
           loader: Sequence[str] = ()) -> ModelState:
    """Register an SGLang ``model`` with refit; returns its fresh state.

    ``specs`` lists the HF checkpoint tensors it is refitted from (default: the inventory of its
    config, for the decoder families :func:`refit_core.kit.models.checkpoint_specs` knows); ``loader``
    forces HF names matching these regular expressions onto SGLang's own ``load_weights``.
    Models that were never attached are attached with the defaults on first use.
    """
    state = ModelState(list(specs) if specs is not None else config_specs(model), tuple(loader))
    _STATES[model] = state
    return state


def state_of(model: Any) -> ModelState | None:
    """The state of an SGLang model (attaching it with the defaults if needed), else None."""
    state = _STATES.get(model) if isinstance(model, torch.nn.Module) else None
    if state is not None or not is_sglang_model(model):
        return state
    return attach(model)
