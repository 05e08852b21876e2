"""Helpers for engine and trainer plugin authors: every one a refit plugin's hooks may build on, from this module.

What a plugin speaks to refit (the data model, ``Backend``, ``hookimpl``, errors) is :mod:`refit_core`. Here:

- engines: trace an engine's own loader on meta tensors (:func:`trace_loads` gives a :class:`Trace`; subclass
  :class:`TensorSwap` for tensors it repacks, :func:`meta_copy`) and plan fast-path pieces from the trace
  (:func:`plan_model` gives a :class:`ModelPlan` of :class:`PlannedPiece`); the same tensor-parallel decoder
  layouts from metadata alone (:func:`decoder_pieces`, :class:`EngineRank`); an adapter's
  boxes in an engine's LoRA slots (:class:`AdapterSlots`, :class:`SlotPlan`, :class:`SlotBox`);
- the serving guard after a failed step (:func:`refuse_serving`, :func:`resume_serving`) and the engine-wide
  serving verdict every multi-rank engine settles after each step (:func:`own_rank_state` gives a
  :class:`RankState`, :func:`gather_reports` exchanges them as :class:`WorkerReport`, :func:`settle_serving`
  applies :func:`serving_verdict`; :func:`refuse_engine`, :func:`resume_engine`, :func:`engine_refusal` and
  :class:`EngineRefusesError` are the refusal itself, :class:`Suspect` why a rank needs a refit);
- trainers and metadata: :class:`ModuleTensors` (a module tree's tensors, listed cheaply before every step),
  :func:`checkpoint_specs` and :func:`config_dtype` (a checkpoint's tensors from its ``config.json``),
  :func:`safetensors_specs` (from a model directory's safetensors headers).

``refit demo`` programs, rank launching, reference weights and bitwise checks, RL and Ray are
:mod:`refit_core.apps`; the
conformance kit is :mod:`refit_core.testing`. The submodules of this package are internal paths: import their
names from here. Names that left ``__all__`` still import until refit 0.3, with a :class:`DeprecationWarning`
naming their new place (:data:`MOVED`).
"""

from __future__ import annotations

from refit_core import _compat
from refit_core.kit.guard import (
    EngineRefusesError,
    engine_refusal,
    refuse_engine,
    refuse_serving,
    resume_engine,
    resume_serving,
)
from refit_core.kit.loadplan import ModelPlan, PlannedPiece, plan_model
from refit_core.kit.loadtrace import TensorSwap, Trace, meta_copy, trace_loads
from refit_core.kit.inventory import safetensors_specs
from refit_core.kit.models import checkpoint_specs, config_dtype
from refit_core.kit.serving import (
    RankState,
    Suspect,
    WorkerReport,
    gather_reports,
    own_rank_state,
    serving_verdict,
    settle_serving,
)
from refit_core.kit.slots import AdapterSlots, SlotBox, SlotPlan
from refit_core.kit.tensors import ModuleTensors
from refit_core.kit.tplayout import EngineRank, decoder_pieces

__all__ = [
    "AdapterSlots", "EngineRank", "EngineRefusesError", "ModelPlan", "ModuleTensors", "PlannedPiece", "RankState",
    "SlotBox", "SlotPlan", "Suspect", "TensorSwap", "Trace", "WorkerReport", "checkpoint_specs", "config_dtype",
    "decoder_pieces", "engine_refusal", "gather_reports", "meta_copy", "own_rank_state", "plan_model",
    "refuse_engine", "refuse_serving", "resume_engine", "resume_serving", "safetensors_specs", "serving_verdict",
    "settle_serving", "trace_loads",
]

_APPS = "import it from refit_core.apps"
_TRACE = "read it off the Trace that trace_loads returns (Trace.targets, Trace.writes)"
MOVED: dict[str, tuple[str, str]] = {
    # name: (module holding it, where to take it from now)
    "DemoContext": ("refit_core.kit.demo", _APPS),
    "DemoProgram": ("refit_core.kit.demo", "a DemoPrograms side is any callable DemoContext -> DemoReport"),
    "DemoPrograms": ("refit_core.kit.demo", _APPS),
    "DemoReport": ("refit_core.kit.demo", _APPS),
    "Phase": ("refit_core.kit.demo", "report through DemoContext.progress"),
    "ProgressLog": ("refit_core.kit.demo", "it is DemoContext.progress"),
    "send_versions": ("refit_core.kit.demo", _APPS),
    "train_demo": ("refit_core.kit.demo", _APPS),
    "spawn": ("refit_core.kit.launch", _APPS),
    "free_port": ("refit_core.kit.launch", _APPS),
    "RankFailure": ("refit_core.kit.launch", "refit_core.apps.spawn raises it; catch RuntimeError"),
    "Rollout": ("refit_core.kit.rl", _APPS),
    "completion_logprobs": ("refit_core.kit.rl", _APPS),
    "RayRefit": ("refit_core.kit.ray", _APPS),
    "RefitTrainActor": ("refit_core.kit.ray", _APPS),
    "RefitReceiveActor": ("refit_core.kit.ray", "name it by path in DemoPrograms(rl_gen_actor=...)"),
    "mismatches": ("refit_core.kit.verify", _APPS),
    "same_bytes": ("refit_core.kit.verify", _APPS),
    "reference_region": ("refit_core.kit.verify", _APPS),
    "quantized_reference": ("refit_core.kit.verify", _APPS),
    "reference_state_dict": ("refit_core.kit.models", _APPS),
    "reference_tensor": ("refit_core.kit.models", _APPS),
    "PRESETS": ("refit_core.kit.models", "use refit_core.testing.ModelCase.preset(name)"),
    "load_config": ("refit_core.kit.models", _APPS),
    "model_inventory": ("refit_core.kit.models", "use checkpoint_specs(config)"),
    "ModelInventory": ("refit_core.kit.models", "use checkpoint_specs(config)"),
    "head_dim": ("refit_core.kit.models", "read it from the model's config.json"),
    "num_experts": ("refit_core.kit.models", "read it from the model's config.json"),
    "transformers_config": ("refit_core.kit.inventory", "use checkpoint_specs(config)"),
    "Fill": ("refit_core.kit.loadtrace", _TRACE),
    "Target": ("refit_core.kit.loadtrace", _TRACE),
    "Write": ("refit_core.kit.loadtrace", _TRACE),
    "view_as_box": ("refit_core.kit.loadtrace", _TRACE),
    "torn_tensors": ("refit_core.kit.guard", "refit_core.RefitReceiver.last_failure names torn tensors"),
    "TornWeightsError": ("refit_core.kit.guard", "catch refit_core.RefitError"),
    "Piece": ("refit_core.contract.pieces", "use refit_core.SourcePiece | refit_core.DestinationPiece"),
    "read_env": ("refit_core.contract.env:read", "refit reads its REFIT_* variables itself; a plugin reads its own"),
    "format_bytes": ("refit_core.units", "format sizes yourself"),
    "format_duration": ("refit_core.units", "format durations yourself"),
    "BoxIndex": ("refit_core.plan.regions", "nowhere public (planner internals)"),
    "first_overlap": ("refit_core.plan.regions", "nowhere public (planner internals)"),
}
"""Names that left ``__all__`` (refit 0.3's smaller surface): where each lives, and what to use instead."""

__getattr__ = _compat.moved_names(__name__, MOVED)
