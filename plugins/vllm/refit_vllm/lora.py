"""Adapter mode: a LoRA adapter's tensors straight into the LoRA slots of a vLLM engine.

The engine serves with LoRA enabled (``LLM(..., enable_lora=True, max_lora_rank=R, max_loras=N)``).
A refit session for a :class:`refit_core.LoraSpec` (``init_info["lora"]`` / ``refit_init(lora=...)``)
receives into an :class:`AdapterTarget` instead of the model's weights:

- **Registration, once per name** (:func:`register`): the adapter is built in memory (zeros, no file)
  with vLLM's own ``LoRAModel.from_lora_tensors`` and ``PEFTHelper``, added to the worker's LoRA
  manager, activated in a slot and pinned there (so vLLM never evicts it and never re-copies its
  registration-time values over refit's), and kept there when vLLM drops every adapter after a
  weight update (``reset_lora_state``: refit's deltas do not depend on the base weights). Its
  ``lora_int_id`` is :func:`lora_int_id` of its name, so :func:`lora_request` gives the
  ``LoRARequest`` that generates with it. A later session for the same name finds it registered
  and overwrites the same slot.
- **Where bytes land, learned from vLLM itself** (:func:`plan_slots`): each LoRA layer's own
  ``set_lora`` runs once on meta tensors (``refit_core.kit``'s load tracer), so the TP slicing
  (column-parallel B, row-parallel A), the fused ``qkv_proj`` / ``gate_up_proj`` slices and KV-head
  replication are exactly vLLM's: each adapter tensor (PEFT's name minus ``base_model.model.``)
  lands as boxes in views of ``lora_a_stacked`` / ``lora_b_stacked`` at the adapter's slot.
- **Every step**: the slot regions are saved (adapter bytes only), the bytes land in place, then B is
  multiplied by ``alpha / r`` in the slot's dtype -- the transform vLLM's loader applies
  (``LoRALayerWeights.optimize``), so the slot's bytes equal what vLLM's ``add_lora`` of the same
  adapter puts there. A failed step puts the saved bytes back: the adapter serves its previous
  version. The base weights are not touched.
- **Refused at setup, naming the module** (:class:`~refit_core.PlanError`, on every rank before any
  byte moves): an engine without ``enable_lora``, a rank above ``max_lora_rank``, a target module the
  engine's LoRA layers do not have, MoE experts (vLLM CPU 0.32 has no fused-MoE LoRA kernels; not
  written for CUDA either), a name whose registered shape differs, more refit adapters than
  ``max_loras``. A dtype the slots do not hold is cast by the sender (as vLLM's loader casts to
  ``lora_dtype``), or refused by the core's planner with ``RefitOptions(cast="strict")``.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import LoraMode, LoraSpec, OptionError, PlanError, TensorSpec, adapter_tensor_names
from refit_core.kit import AdapterSlots, SlotBox, SlotPlan, TensorSwap, Trace, meta_copy, trace_loads

from .checkpoint import engine_checkpoint_specs
from .state import state_of

log = logging.getLogger("refit.vllm")

PEFT_PREFIX = "base_model.model."
"""What PEFT's adapter checkpoints put before the model's module names."""

_B_SUFFIX = adapter_tensor_names("")[1]  # ".lora_B.weight"

SLOT_TENSORS = ("lora_a_stacked", "lora_b_stacked")
"""A vLLM LoRA layer's slot tensors, one per fused slice: ``[slots, 1, rank, in]``, ``[slots, 1, out, rank]``."""


def lora_int_id(name: str) -> int:
    """The ``lora_int_id`` refit registers adapter ``name`` under (stable across processes, > 0)."""
    return zlib.crc32(name.encode()) % 0x7FFFFFFE + 1


def lora_request(name: str) -> Any:
    """The ``vllm.lora.request.LoRARequest`` that generates with refit's adapter ``name`` (its path
    is a placeholder: the adapter is registered in every worker already, so vLLM never reads it)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_int_id(name), lora_path=f"refit://{name}")


@dataclass(frozen=True)
class SlotPiece(SlotBox):
    """Where one box of an adapter tensor lands: ``tensor`` of LoRA layer ``layer``, viewed as strided."""

    layer: str
    tensor: str
    """``lora_a_stacked.{i}`` or ``lora_b_stacked.{i}``."""


@dataclass
class AdapterTarget(AdapterSlots):
    """What a gen rank's :class:`refit_core.RefitReceiver` receives into in adapter mode: adapter
    ``spec`` in the LoRA slots of the vLLM ``model``. ``version`` is the last version that landed
    (None before the first); ``saved`` holds the slot bytes a running step may overwrite (None
    outside a step)."""

    model: torch.nn.Module
    spec: LoraSpec
    plan: SlotPlan | None = field(default=None, init=False)
    """Where the adapter's boxes land (set when the target is built: :func:`register`)."""
    version: int | None = field(default=None, init=False)
    saved: list[torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.plan = register(self.model, self.spec)

    def live_slot(self, piece: SlotBox) -> torch.Tensor:
        assert isinstance(piece, SlotPiece)
        return _slot_tensor(_manager(self.model).modules[piece.layer], piece.tensor)

    def begin(self) -> None:
        """Before any byte lands: fail with the error the engine refused this step with (as for the
        weights, :func:`refit_vllm.state.refuse_next_step`), else save the slot bytes the step overwrites."""
        state = state_of(self.model)
        if state is not None and state.refusal is not None:
            error, state.refusal = state.refusal, None
            raise error
        super().begin()

    def finish(self, version: int) -> None:
        """The bytes landed: fold ``alpha / r`` into B as vLLM's loader does (``lora_b *= scaling``)."""
        assert self.plan is not None
        scale = self.spec.scale
        if scale != 1:
            with torch.no_grad():
                for p, view in zip(self.plan.pieces, self.views()):
                    if p.spec.name.endswith(_B_SUFFIX):
                        view *= scale
        super().finish(version)
        _registered(_manager(self.model))[self.spec.name].version = version


def lora_spec(value: LoraSpec | dict[str, Any] | str) -> LoraSpec:
    """A :class:`refit_core.LoraSpec` from itself, its fields or its ``--lora`` text; it must be adapter mode
    (a merged-mode engine serves plain weights and is given no spec)."""
    if isinstance(value, str):
        spec = LoraSpec.parse(value)
    elif isinstance(value, dict):
        fields = dict(value)
        if "targets" in fields:
            fields["targets"] = tuple(fields["targets"])
        spec = LoraSpec(**fields)
    else:
        spec = value
    if spec.mode is not LoraMode.ADAPTER:
        raise OptionError(f"refit adapter {spec.name!r}: the engine takes a LoraSpec in adapter mode only; in "
                          f"{spec.mode.value} mode it serves plain weights (refit it without lora)")
    return spec


# -- the engine's LoRA manager ------------------------------------------------------------------


def _manager(model: torch.nn.Module) -> Any:
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise PlanError("refit adapter mode: this vLLM engine serves without LoRA; start it with "
                        "enable_lora=True, max_lora_rank=<at least the adapter's r>, max_loras=<adapters>")
    return manager


def _slot_tensor(layer: torch.nn.Module, name: str) -> torch.Tensor:
    attr, index = name.rsplit(".", 1)
    return getattr(layer, attr)[int(index)]


def _held_modules(manager: Any, layer: str) -> list[str]:
    """The HF modules a vLLM LoRA layer holds: its fused slices' names, else its own."""
    return list(manager.packed_modules.get(layer, [layer]))


def _adapted_modules(manager: Any) -> dict[str, tuple[str, int | None]]:
    """HF module name -> (the vLLM linear LoRA layer holding it, its slice in a fused layer or None)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    out: dict[str, tuple[str, int | None]] = {}
    for layer, module in manager.modules.items():
        if isinstance(module, BaseLinearLayerWithLoRA):
            fused = layer in manager.packed_modules
            out.update({sub: (layer, i if fused else None) for i, sub in enumerate(_held_modules(manager, layer))})
    return out


def _refuse_other_layers(manager: Any, spec: LoraSpec, adapted: dict[str, tuple[str, int | None]]) -> None:
    """A target that reaches a LoRA layer refit does not write (MoE experts, embeddings, lm_head) is refused."""
    for layer, module in manager.modules.items():
        hit = [m for m in _held_modules(manager, layer) if m not in adapted and spec.targets_module(m)]
        if hit:
            kind = type(module).__name__
            why = ("vLLM CPU 0.32 has no fused-MoE LoRA kernels, and adapter mode does not write MoE slots; use "
                   "LoraMode.MERGED" if "MoE" in kind else "adapter mode writes linear LoRA layers only")
            raise PlanError(f"refit adapter {spec.name!r}: target {hit[0]} is held by {layer} ({kind}): {why}")


_REGISTERED_ATTR = "_refit_adapters"


@dataclass
class Registered:
    """An adapter refit registered in an engine: its shape and the last version that landed in its slot
    (None: none yet, it holds zeros)."""

    spec: LoraSpec
    version: int | None = None


def _registered(manager: Any) -> dict[str, Registered]:
    """The adapters refit registered in this manager, by name."""
    if not hasattr(manager, _REGISTERED_ATTR):
        setattr(manager, _REGISTERED_ATTR, {})
    return getattr(manager, _REGISTERED_ATTR)


def adapter_versions(model: torch.nn.Module) -> dict[str, int | None]:
    """Each refit adapter of this worker's engine and the version its slot holds (empty without LoRA)."""
    manager = getattr(model, "lora_manager", None)
    return {} if manager is None else {name: r.version for name, r in _registered(manager).items()}


def adapter_specs(model: torch.nn.Module, spec: LoraSpec) -> tuple[TensorSpec, ...]:
    """The adapter tensors (A ``[r, in]``, B ``[out, r]`` of every HF module ``spec`` targets) in the
    dtype of the engine's slots; :class:`~refit_core.PlanError` naming what the engine cannot hold."""
    manager = _manager(model)
    config = manager.lora_config
    if spec.rank > config.max_lora_rank:
        raise PlanError(f"refit adapter {spec.name!r}: rank r={spec.rank} exceeds the engine's max_lora_rank="
                        f"{config.max_lora_rank} (start vLLM with max_lora_rank >= {spec.rank})")
    adapted = _adapted_modules(manager)
    _refuse_other_layers(manager, spec, adapted)
    leaves = sorted({m.rsplit(".", 1)[-1] for m in adapted})
    missing = [t for t in spec.targets if t not in leaves]
    if missing:
        raise PlanError(f"refit adapter {spec.name!r}: target module(s) {missing} are not LoRA layers of this vLLM "
                        f"engine (it adapts {leaves})")
    modules = sorted(m for m in adapted if spec.targets_module(m))
    weights = {s.name: s for s in engine_checkpoint_specs(_model_config(model))}
    specs = []
    for module in modules:
        weight = weights.get(f"{module}.weight")
        if weight is None or len(weight.shape) != 2:
            raise PlanError(f"refit adapter {spec.name!r}: {module} has no 2-D HF weight in the engine's checkpoint "
                            "to size its adapter from")
        out_features, in_features = weight.shape
        a, b = adapter_tensor_names(module)
        specs += [TensorSpec(a, (spec.rank, in_features), config.lora_dtype),
                  TensorSpec(b, (out_features, spec.rank), config.lora_dtype)]
    return tuple(specs)


def _model_config(model: torch.nn.Module) -> Any:
    state = state_of(model)
    if state is None:
        raise PlanError("refit adapter mode: no vLLM engine config for this model (attach it first)")
    return state.model_config


def register(model: torch.nn.Module, spec: LoraSpec) -> SlotPlan:
    """Register adapter ``spec`` (zeros, in memory) in the engine's LoRA manager once, active and pinned
    in a slot; return where its tensors land. A name registered before keeps its slot."""
    manager = _manager(model)
    specs = adapter_specs(model, spec)
    known = _registered(manager)
    previous = known[spec.name].spec if spec.name in known else None
    if previous is not None and (previous.rank, previous.alpha, previous.targets) != (spec.rank, spec.alpha,
                                                                                     spec.targets):
        raise PlanError(f"refit adapter {spec.name!r} is registered in this engine with r={previous.rank}, "
                        f"alpha={previous.alpha}, targets={list(previous.targets)}; a different shape needs a new "
                        "name")
    if previous is None and len(known) >= manager.lora_slots:
        raise PlanError(f"refit adapter {spec.name!r}: the engine's {manager.lora_slots} LoRA slot(s) (max_loras) "
                        f"already hold refit adapters {sorted(known)}; start vLLM with max_loras >= {len(known) + 1}")
    lora_id = lora_int_id(spec.name)
    if previous is None:
        _keep_across_resets(manager)
        _add_zero_adapter(manager, spec, lora_id, specs)
        known[spec.name] = Registered(spec)
    if lora_id not in manager.lora_index_to_id:
        manager.activate_adapter(lora_id)
    slot = manager.lora_index_to_id.index(lora_id)
    plan = plan_slots(manager, specs, slot)
    log.info("refit: adapter %r (lora_int_id %d) in LoRA slot %d: %d tensors, %d pieces", spec.name, lora_id, slot,
             len(specs), len(plan.pieces))
    return plan


def _keep_across_resets(manager: Any) -> None:
    """vLLM drops every adapter after each weight update (the worker's ``finish_weight_update`` calls
    ``reset_lora_state``, which calls the manager's ``remove_all_adapters``), and would then load a
    refit adapter from its placeholder path. Refit's adapters are put back in their slots, bytes
    untouched (``remove_all_adapters`` only forgets them): their deltas do not depend on the base weights."""
    if getattr(manager, "_refit_keeps_adapters", False):
        return
    remove_all = manager.remove_all_adapters

    def remove_all_but_refits() -> None:
        kept = [(i, manager._registered_adapters.get(i), manager.lora_index_to_id.index(i))
                for i in (lora_int_id(name) for name in _registered(manager)) if i in manager.lora_index_to_id]
        remove_all()
        for lora_id, lora, slot in kept:
            manager._registered_adapters[lora_id] = lora
            manager._registered_adapters.pin(lora_id)
            manager._active_adapters[lora_id] = None
            manager._active_adapters.pin(lora_id)
            manager.lora_index_to_id[slot] = lora_id

    manager.remove_all_adapters = remove_all_but_refits
    manager._refit_keeps_adapters = True


def _add_zero_adapter(manager: Any, spec: LoraSpec, lora_id: int, specs: tuple[TensorSpec, ...]) -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets),
                                   "bias": "none"})
    try:
        helper.validate_legal(manager.lora_config)
    except ValueError as exc:
        raise PlanError(f"refit adapter {spec.name!r}: vLLM refuses it: {exc}") from exc
    tensors = {PEFT_PREFIX + s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype)
    manager.add_adapter(lora)
    manager.activate_adapter(lora_id)
    manager.pin_adapter(lora_id)


# -- where the bytes land: vLLM's own set_lora, traced on meta tensors ---------------------------


class _SlotSwap(TensorSwap):
    """Swaps the slot tensors of the given LoRA layers for meta copies (they are tuples of plain
    attributes, not parameters), and back."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> None:
        super().__init__(model)
        self.layers = {id(layer): name for name, layer in layers.items()}
        self.live: list[tuple[torch.nn.Module, str, tuple[torch.Tensor, ...]]] = []

    def _swap_module(self, mod_name: str, module: torch.nn.Module, live_params: dict, live_buffers: dict) -> bool:
        name = self.layers.get(id(module))
        if name is None:
            return False
        for attr in SLOT_TENSORS:
            tensors = getattr(module, attr)
            self.live.append((module, attr, tensors))
            setattr(module, attr, tuple(self.register(name, f"{attr}.{i}", t, meta_copy(t), restored=False,
                                                      load_numel=t.numel()) for i, t in enumerate(tensors)))
        return False

    def __exit__(self, *exc: object) -> None:
        for module, attr, tensors in reversed(self.live):
            setattr(module, attr, tensors)
        self.live.clear()
        super().__exit__(*exc)


class _SetLora:
    """A stand-in model whose ``load_weights`` hands the traced adapter tensors to each LoRA layer's own
    ``set_lora(slot, ...)``: lists of per-slice tensors (None where a slice is not adapted) for fused layers.

    The layer's ``reset_lora`` (zeros over the whole slot first) is not traced: registration zeroed the
    slot, and every step rewrites every byte of the adapter's boxes."""

    def __init__(self, manager: Any, calls: dict[str, list[str | None]], slot: int) -> None:
        self.manager, self.calls, self.slot = manager, calls, slot

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        given = dict(weights)
        for layer, modules in self.calls.items():
            a = [None if m is None else given[adapter_tensor_names(m)[0]] for m in modules]
            b = [None if m is None else given[adapter_tensor_names(m)[1]] for m in modules]
            fused = layer in self.manager.packed_modules
            module = self.manager.modules[layer]
            module.reset_lora = _no_reset
            try:
                module.set_lora(self.slot, a if fused else a[0], b if fused else b[0])
            finally:
                del module.reset_lora


def _no_reset(index: int) -> None:
    """Stands in for a layer's ``reset_lora`` while its ``set_lora`` is traced."""


def plan_slots(manager: Any, specs: tuple[TensorSpec, ...], slot: int) -> SlotPlan:
    """Run every adapted layer's ``set_lora(slot, ...)`` on meta tensors and record where each box of
    each adapter tensor lands; :class:`~refit_core.PlanError` if a layer does anything but box copies."""
    adapted = _adapted_modules(manager)
    calls: dict[str, list[str | None]] = {}
    for s in specs:
        module = s.name.rsplit(".", 2)[0]  # an adapter tensor is "<module>.lora_A.weight" or "...lora_B.weight"
        assert s.name in adapter_tensor_names(module)
        layer, index = adapted[module]
        subs = manager.packed_modules.get(layer)
        calls.setdefault(layer, [None] * (1 if subs is None else len(subs)))[index or 0] = module
    layers = {name: manager.modules[name] for name in calls}
    trace = trace_loads(_SetLora(manager, calls, slot), list(specs),  # type: ignore[arg-type]
                        swap=lambda _: _SlotSwap(manager.model, layers))
    if trace.rejected:
        name, why = next(iter(trace.rejected.items()))
        raise PlanError(f"refit adapter mode: vLLM's LoRA layer for {name} refuses it: {why}")
    return _slot_plan(trace, specs, slot)


def _slot_plan(trace: Trace, specs: tuple[TensorSpec, ...], slot: int) -> SlotPlan:
    if trace.opaque:
        (layer, tensor), why = next(iter(trace.opaque.items()))
        raise PlanError(f"refit adapter mode: vLLM's LoRA layer {layer} writes {tensor} with {why}; refit writes "
                        "only box copies")
    by_name = {s.name: s for s in specs}
    pieces = [SlotPiece(spec=by_name[w.hf_name], box=w.hf_box, offset=w.offset, strides=w.strides, layer=w.target[0],
                        tensor=w.target[1]) for w in trace.writes]
    # under tensor parallelism a rank holds a slice of each tensor (row-parallel A, column-parallel B)
    unwritten = sorted(set(by_name) - {p.spec.name for p in pieces})
    if unwritten:
        raise PlanError(f"refit adapter mode: vLLM's LoRA layers hold nothing of {unwritten[0]} "
                        f"({len(unwritten)} adapter tensor(s) not placed)")
    _check_targets(trace)
    return SlotPlan(slot, specs, tuple(pieces))


def _check_targets(trace: Trace) -> None:
    """Slot tensors must be dense (their views are built from traced offsets and strides)."""
    for (layer, name), t in trace.targets.items():
        if t.stride != tuple(torch.empty(t.shape, device="meta").stride()):
            raise PlanError(f"refit adapter mode: {layer}.{name} is not a dense tensor")


__all__ = ["AdapterTarget", "Registered", "SlotPiece", "adapter_specs", "adapter_versions", "lora_int_id",
           "lora_request", "lora_spec", "plan_slots", "register"]
