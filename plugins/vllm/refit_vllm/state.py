"""Per-model state of the vLLM plugin: the engine config a model belongs to, its plan, its version."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core import RefitError

from refit_core.kit import ModelPlan

from .checkpoint import UnplannableConfigError

log = logging.getLogger("refit.vllm")

MODE_ENV = "REFIT_VLLM_MODE"
"""``auto`` (default): write live tensors directly where that is safe (CUDA, unquantized dense,
no loader path), else drive vLLM's layerwise reload; ``reload`` or ``direct`` force one."""

LOADER_ENV = "REFIT_VLLM_LOADER"
"""Comma-separated regular expressions of HF names forced onto the loader path (debugging)."""


def read_setting(variable: str) -> str | None:
    """The value of this plugin's variable ``variable`` (:data:`MODE_ENV`, :data:`LOADER_ENV`), or None when
    unset: the plugin's one environment reader."""
    return os.environ.get(variable)


@dataclass
class ModelState:
    """What the plugin knows about one live vLLM model."""

    vllm_config: Any
    loader_patterns: tuple[str, ...] = ()
    plan: ModelPlan | None = None
    mode: str | None = None
    updating: bool = False
    version: int | None = None
    refusal: Exception | None = None
    """The error the next step fails with before any byte lands (None: the step runs)."""
    subset: frozenset[str] | None = None
    """The HF tensors the step under way moves (None: all): its reload post-processes only their modules."""

    @property
    def model_config(self) -> Any:
        return self.vllm_config.model_config


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, ModelState] = weakref.WeakKeyDictionary()


def is_vllm_model(model: Any) -> bool:
    """A model built by vLLM's loader (it recorded reload metadata for it) -- never imports vLLM."""
    if "vllm" not in sys.modules or not isinstance(model, torch.nn.Module):
        return False
    if not callable(getattr(model, "load_weights", None)):
        return False
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return model in LAYERWISE_INFO


def attach(model: torch.nn.Module, vllm_config: Any, *, loader: Sequence[str] = ()) -> ModelState:
    """Register ``model`` (the worker's model) with its engine config; returns its fresh state (a new
    plan; the weight version it holds carries over)."""
    patterns = tuple(loader) + tuple(p for p in (read_setting(LOADER_ENV) or "").split(",") if p)
    previous = _STATES.get(model)
    state = ModelState(vllm_config, patterns, version=None if previous is None else previous.version)
    _STATES[model] = state
    return state


def ensure_attached(model: torch.nn.Module, vllm_config: Any) -> ModelState:
    """``model``'s state, attaching it to ``vllm_config`` if nothing did yet (keeps an existing plan)."""
    state = _STATES.get(model)
    return state if state is not None else attach(model, vllm_config)


def refuse_next_step(model: torch.nn.Module, error: Exception) -> None:
    """Make the model's next refit step fail with ``error`` as it begins, before any byte lands (the
    engine refuses a step its trainers have started: they hear it as of any failed step)."""
    state = _STATES.get(model)
    if state is None:
        raise RefitError("refit_vllm: refuse_next_step on a model no refit session attached") from error
    state.refusal = error


def state_of(model: Any) -> ModelState | None:
    """The state of a vLLM model (attaching it to the current vLLM config if needed), else None."""
    state = _STATES.get(model) if isinstance(model, torch.nn.Module) else None
    if state is not None or not is_vllm_model(model):
        return state
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        raise RefitError("refit found a vLLM model with no engine config: call refit_vllm.attach(model, "
                         "vllm_config) first, or use the 'refit' weight-transfer backend / "
                         "RefitWorkerExtension, which do")
    return attach(model, config)


@contextlib.contextmanager
def engine_context(state: ModelState) -> Iterator[None]:
    """vLLM's current-config context (loaders and post-processing may consult it)."""
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is state.vllm_config:
        yield
        return
    with set_current_vllm_config(state.vllm_config):
        yield


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


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
