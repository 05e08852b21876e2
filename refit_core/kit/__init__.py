"""The plugin author's toolbox: every helper a refit plugin may import, from this one module.

What a plugin speaks to refit (the data model, ``Backend``, ``hookimpl``, settings, errors) is in
:mod:`refit_core`; what it may use to build its pieces, its demo programs and its tests is here: model
inventories and reference weights, load tracing and planning for engines, tensor-parallel decoder layouts,
an adapter's boxes in an engine's LoRA slots (:class:`AdapterSlots`),
bitwise verification (:func:`same_bytes`: equal bytes, not equal values), the serving guard and the
engine-wide serving verdict, rank launching, ``refit demo`` programs (:class:`DemoPrograms`, registered
through the hook ``refit_register_demos`` of :class:`refit_core.kit.demo.DemoHookspecs`), RL-loop pieces
and the Ray driver. The conformance kit is
:mod:`refit_core.testing`.

The submodules of this package are internal paths: import their names from here. The Ray names
(:class:`RayRefit`, :class:`RefitTrainActor`, :class:`RefitReceiveActor`) load Ray on first use only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from refit_core.contract.env import read as read_env
from refit_core.contract.pieces import Piece
from refit_core.kit.demo import (
    DemoContext,
    DemoProgram,
    DemoPrograms,
    DemoReport,
    Phase,
    ProgressLog,
    send_versions,
    train_demo,
)
from refit_core.kit.guard import (
    EngineRefusesError,
    TornWeightsError,
    engine_refusal,
    refuse_engine,
    refuse_serving,
    resume_engine,
    resume_serving,
    torn_tensors,
)
from refit_core.kit.inventory import safetensors_specs, transformers_config
from refit_core.kit.launch import RankFailure, free_port, spawn
from refit_core.kit.loadplan import ModelPlan, PlannedPiece, plan_model
from refit_core.kit.loadtrace import Fill, Target, TensorSwap, Trace, Write, meta_copy, trace_loads, view_as_box
from refit_core.kit.models import (
    PRESETS,
    ModelInventory,
    checkpoint_specs,
    config_dtype,
    head_dim,
    load_config,
    model_inventory,
    num_experts,
    reference_state_dict,
    reference_tensor,
)
from refit_core.kit.rl import Rollout, completion_logprobs
from refit_core.kit.slots import AdapterSlots, SlotBox, SlotPlan
from refit_core.kit.tensors import ModuleTensors
from refit_core.kit.serving import (
    RankState,
    Suspect,
    WorkerReport,
    gather_reports,
    own_rank_state,
    serving_verdict,
    settle_serving,
)
from refit_core.kit.tplayout import EngineRank, decoder_pieces
from refit_core.kit.verify import mismatches, quantized_reference, reference_region, same_bytes
from refit_core.plan.regions import BoxIndex, first_overlap
from refit_core.units import format_bytes, format_duration

if TYPE_CHECKING:
    from refit_core.kit.ray import RayRefit, RefitReceiveActor, RefitTrainActor

_LAZY = {"RayRefit": "refit_core.kit.ray", "RefitReceiveActor": "refit_core.kit.ray",
         "RefitTrainActor": "refit_core.kit.ray"}
"""Names whose module is heavy to import (Ray): loaded on first access."""

__all__ = [
    "PRESETS", "AdapterSlots", "BoxIndex", "DemoContext", "DemoProgram", "DemoPrograms", "DemoReport", "EngineRank",
    "EngineRefusesError", "Fill", "ModelInventory", "ModelPlan", "ModuleTensors", "Phase", "Piece", "PlannedPiece",
    "ProgressLog",
    "RankFailure", "RankState", "RayRefit", "RefitReceiveActor", "RefitTrainActor", "Rollout", "SlotBox", "SlotPlan",
    "Suspect", "Target",
    "TensorSwap", "TornWeightsError", "Trace", "WorkerReport", "Write", "checkpoint_specs", "completion_logprobs",
    "config_dtype", "decoder_pieces", "engine_refusal", "first_overlap", "format_bytes", "format_duration", "free_port",
    "gather_reports", "head_dim", "load_config", "meta_copy", "mismatches", "model_inventory", "num_experts",
    "own_rank_state", "plan_model", "quantized_reference", "read_env", "reference_region", "reference_state_dict",
    "reference_tensor", "refuse_engine", "refuse_serving", "resume_engine", "resume_serving", "safetensors_specs",
    "same_bytes",
    "send_versions", "serving_verdict", "settle_serving", "spawn", "torn_tensors", "trace_loads", "train_demo",
    "transformers_config", "view_as_box",
]


def __getattr__(name: str) -> Any:
    """The lazily loaded names of :data:`_LAZY`."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
