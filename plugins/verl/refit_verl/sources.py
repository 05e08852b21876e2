"""What refit moves in a verl job: the actor's FSDP2 or Megatron model, read in place, and the rollout's
destination.

verl builds the checkpoint engine inside its workers (``ActorRolloutRefWorker`` / ``TrainingWorker`` on
the actor side, ``CheckpointEngineWorker`` on the rollout side) and calls it through the worker's
``execute_checkpoint_engine``, so the engine finds its models on the worker that holds it
(:func:`worker_holding`). Duck-typed: nothing here imports verl.
"""

from __future__ import annotations

import sys
from typing import Any

from refit_core import PluginError

from .megatron import is_megatron_engine, megatron_source

_FRAMES = 12
"""How far up the call stack the worker holding an engine may be (verl's dispatch adds a few frames)."""


def is_training_engine(model: Any) -> bool:
    """Whether ``model`` is a verl training engine (``verl.workers.engine``'s FSDP and Megatron engines, kin)."""
    return type(model).__module__.startswith("verl.") and hasattr(model, "module") and hasattr(model, "engine_config")


def source_model(engine: Any) -> Any:
    """The model refit reads on a train rank: the engine's FSDP2 module (a PEFT model for LoRA, moved
    in refit's adapter mode; ``lora.merge=True`` folds the adapters in on the way, refit's merged mode), or
    a Megatron engine's chunks as refit-plugin-megatron's ``MegatronSource``."""
    if is_megatron_engine(engine):
        return megatron_source(engine)
    from refit_dtensor.lora import merged, peft_of

    module = engine.module
    if type(module).__name__ == "FullyShardedDataParallel":
        raise PluginError("verl actor: refit reads FSDP2 (DTensor) shards in place; FSDP1 flat parameters are "
                          "not supported: set actor_rollout_ref.actor.strategy=fsdp2")
    lora = getattr(getattr(engine, "model_config", None), "lora", None) or {}
    if peft_of(module) is not None and lora.get("merge", False):
        return merged(module)
    return module


def worker_holding(engine: object) -> Any:
    """The verl worker whose ``checkpoint_engine`` is ``engine``, found among its callers' ``self``."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not engine and getattr(owner, "checkpoint_engine", None) is engine:
            return owner
        frame = frame.f_back
    raise PluginError("refit checkpoint engine: no verl worker holding this engine called it; outside verl's "
                      "workers, give the engine its model with engine.bind(model)")


def training_engine(worker: Any) -> Any:
    """The training engine of an actor worker (``ActorRolloutRefWorker.actor.engine``, ``TrainingWorker.engine``)."""
    engine = getattr(getattr(worker, "actor", None), "engine", None) or getattr(worker, "engine", None)
    if engine is None or not is_training_engine(engine):
        raise PluginError(f"refit checkpoint engine: {type(worker).__name__} holds no verl training engine")
    return engine


def rollout_model(worker: Any) -> Any:
    """The model a rollout worker's server adapter serves from, in this process (``refit_model``, else
    ``model``): refit writes the new weights straight into its parameters."""
    adapter = getattr(worker, "server_adapter", None)
    model = getattr(adapter, "refit_model", None) or getattr(adapter, "model", None)
    if model is None:
        raise PluginError(f"refit checkpoint engine: the rollout's server adapter {type(adapter).__name__} holds no "
                          "model in this process (refit_model / model); refit writes into the rollout's parameters "
                          "where they live, so run its receiver where the engine's model is")
    return model
