"""Adapter mode: a LoRA adapter's tensors straight into the slots of SGLang's LoRA memory pool.

The engine serves with LoRA enabled (``--enable-lora --max-lora-rank R --lora-target-modules ...
--max-loras-per-batch N``); its TP worker's ``model_runner.lora_manager`` (a ``LoRAManager``) holds
the adapters, and its ``memory_pool`` (a ``LoRAMemoryPool``) the per-layer slot buffers
``A_buffer[module][layer]`` ``[slots, r * fused, in]`` and ``B_buffer[module][layer]`` ``[slots, out, r]``.
A refit session for a :class:`refit_core.LoraSpec` receives into an :class:`AdapterTarget`:

- **Registration, once per name** (:func:`register`): an adapter of that name already in the manager
  (registered through SGLang's own ``load_lora_adapter_from_tensors``, as a server does for its
  tokenizer's registry) is used as it is; otherwise refit registers one (zeros, no file) with the
  manager's own ``load_lora_adapter_from_tensors``, *pinned* (SGLang never evicts it, so it never
  re-copies its registration-time CPU values over refit's), then makes it resident in a pool slot
  (the manager's ``fetch_new_loras``). A later session for the same name finds its slot.
- **Where bytes land, learned from SGLang itself** (:func:`plan_slots`): SGLang's own
  ``LoRAAdapter._normalize_weights`` (q/k/v and gate/up stacking) and the pool's
  ``load_lora_weight_to_buffer`` (each LoRA layer's TP slicing, the copy into the slot) run once on
  meta tensors (``refit_core.kit``'s load tracer): each adapter tensor lands as boxes in views of the
  slot buffers.
- **Every step**: the slot regions are saved (adapter bytes only), the bytes land in place. Dense
  modules' slots hold PEFT's unscaled values (cast to the pool dtype): SGLang applies ``alpha / r``
  at run time (``LoRAAdapter.scaling``, from the registered config), so nothing is folded in. A failed
  step puts the saved bytes back. The base weights are not touched.
- **Refused at setup, naming the module** (:class:`~refit_core.PlanError`, before any byte moves): an
  engine without LoRA, a rank above ``max_lora_rank``, a target outside the engine's
  ``--lora-target-modules``, MoE experts (SGLang scales their B in the slot; not written here), a q/k/v
  or gate/up group SGLang cannot stack (no q_proj / v_proj, up without gate), a name registered with
  another shape, no slot left for another pinned adapter (SGLang keeps one of ``max_loras_per_batch``
  unpinned).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import (
    LoraSpec,
    PlanError,
    TensorSpec,
    adapter_tensor_names,
)
from refit_core.kit import AdapterSlots, SlotBox, SlotPlan, TensorSwap, meta_copy, trace_loads

log = logging.getLogger("refit.sglang")

BUFFERS = ("A_buffer", "B_buffer")
"""The pool's slot buffers: module name -> one tensor per layer."""

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""SGLang's stacked LoRA modules and the HF modules they hold, in order."""

_REQUIRED = {"qkv_proj": ("q_proj", "v_proj"), "gate_up_proj": ("gate_proj",)}
"""Members SGLang's ``LoRAAdapter`` needs to stack a group (it fills the others with zeros)."""


@dataclass(frozen=True)
class SlotPiece(SlotBox):
    """Where one box of an adapter tensor lands: ``buffer[module][layer]`` of the pool, viewed as strided."""

    buffer: str
    """``A_buffer`` or ``B_buffer``."""
    module: str
    """The pool's module key (``qkv_proj``, ``o_proj``, ...)."""
    layer: int


@dataclass(frozen=True)
class PoolPlan(SlotPlan):
    """An adapter's place in the pool: a :class:`~refit_core.kit.SlotPlan` and the adapter's ``lora_id``."""

    lora_id: str


@dataclass
class AdapterTarget(AdapterSlots):
    """What a gen rank's :class:`refit_core.RefitReceiver` receives into in adapter mode: adapter ``spec``
    in the LoRA pool of SGLang's ``manager`` (a TP worker's ``model_runner.lora_manager``). ``version``
    is the last version that landed (None before the first); ``saved`` holds the slot bytes a running
    step may overwrite (None outside a step)."""

    manager: Any
    spec: LoraSpec
    plan: PoolPlan | None = field(default=None, init=False)
    version: int | None = field(default=None, init=False)
    saved: list[torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.plan = register(self.manager, self.spec)

    def live_slot(self, piece: SlotBox) -> torch.Tensor:
        assert isinstance(piece, SlotPiece)
        return getattr(self.manager.memory_pool, piece.buffer)[piece.module][piece.layer]


# -- what the engine can hold -----------------------------------------------------------------


def _pool_module(hf_module: str) -> str:
    leaf = hf_module.rsplit(".", 1)[-1]
    return next((fused for fused, members in FUSED.items() if leaf in members), leaf)


def adapter_specs(manager: Any, spec: LoraSpec) -> tuple[TensorSpec, ...]:
    """The adapter tensors (A ``[r, in]``, B ``[out, r]`` of every HF module ``spec`` targets) in the pool's
    dtype; :class:`~refit_core.PlanError` naming what the engine cannot hold."""
    if manager is None or getattr(manager, "memory_pool", None) is None:
        raise PlanError("refit adapter mode: this SGLang engine serves without LoRA; start it with --enable-lora "
                        "--max-lora-rank <at least r> --lora-target-modules <the targets>")
    name = spec.name
    if spec.rank > manager.max_lora_rank:
        raise PlanError(f"refit adapter {name!r}: rank r={spec.rank} exceeds the engine's max_lora_rank="
                        f"{manager.max_lora_rank} (start SGLang with --max-lora-rank >= {spec.rank})")
    _refuse_moe(manager, spec)
    missing = sorted({t for t in spec.targets if _pool_module(t) not in manager.target_modules})
    if missing:
        raise PlanError(f"refit adapter {name!r}: target module(s) {missing} are not LoRA targets of this SGLang "
                        f"engine (its --lora-target-modules: {sorted(manager.target_modules)})")
    for fused, required in _REQUIRED.items():
        group = [t for t in spec.targets if t in FUSED[fused]]
        absent = [r for r in required if r not in spec.targets]
        if group and absent:
            raise PlanError(f"refit adapter {name!r}: SGLang stacks {'/'.join(FUSED[fused])} into {fused} and "
                            f"needs {absent} among the targets {list(spec.targets)}")
    specs = _module_specs(manager, spec.rank, spec.targets_module)
    if not specs:
        raise PlanError(f"refit adapter {name!r}: no decoder-layer weight of this model matches {list(spec.targets)}")
    return specs


def _module_specs(manager: Any, rank: int, adapted: Callable[[str], bool]) -> tuple[TensorSpec, ...]:
    """A and B of every decoder-layer linear module of the base model for which ``adapted(module)``."""
    from .state import config_specs

    specs = []
    for weight in config_specs(manager.base_model):
        module = weight.name.removesuffix(".weight")
        if weight.name == module or len(weight.shape) != 2 or ".layers." not in module or not adapted(module):
            continue
        out_features, in_features = weight.shape
        a, b = adapter_tensor_names(module)
        specs += [TensorSpec(a, (rank, in_features), manager.dtype),
                  TensorSpec(b, (out_features, rank), manager.dtype)]
    return tuple(sorted(specs, key=lambda s: s.name))


def _refuse_moe(manager: Any, spec: LoraSpec) -> None:
    from sglang.srt.lora.layers import FusedMoEWithLoRA

    for layer in manager.lora_modules:
        for module_name, module in layer.items():
            experts = [f"{module_name}.{leaf}" for leaf in ("gate_proj", "up_proj", "down_proj")]
            if isinstance(module, FusedMoEWithLoRA) and any(spec.targets_module(e) for e in experts):
                raise PlanError(f"refit adapter {spec.name!r}: targets {list(spec.targets)} reach the MoE experts "
                                f"of {module_name}: adapter mode writes SGLang's dense LoRA slots only (use "
                                "LoraMode.MERGED)")


# -- registration -----------------------------------------------------------------------------


def _config_dict(spec: LoraSpec) -> dict[str, Any]:
    return {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets),
            "bias": "none"}


def registered_id(manager: Any, name: str) -> str | None:
    """The ``lora_id`` of the adapter named ``name`` in this manager, or None."""
    return next((i for i, ref in manager.lora_refs.items() if ref.lora_name == name), None)


def register(manager: Any, spec: LoraSpec) -> PoolPlan:
    """Register adapter ``spec`` (zeros, pinned) in SGLang's LoRA manager unless one of its name is there,
    make it resident in a pool slot, and return where its tensors land."""
    specs = adapter_specs(manager, spec)
    lora_id = registered_id(manager, spec.name)
    if lora_id is not None:
        config = manager.configs[lora_id]
        if (config.r, float(config.lora_alpha)) != (spec.rank, spec.alpha) or \
                sorted(config.target_modules) != sorted(spec.targets):
            raise PlanError(f"refit adapter {spec.name!r} is registered in this engine with r={config.r}, "
                            f"alpha={config.lora_alpha}, targets={list(config.target_modules)}; a different shape "
                            "needs a new name")
        if not manager.lora_refs[lora_id].pinned:
            raise PlanError(f"refit adapter {spec.name!r} is registered unpinned: SGLang may evict it and reload "
                            "its registration values over refit's; register it with pinned=True")
    else:
        lora_id = _add_zero_adapter(manager, spec, specs)
    if lora_id not in manager.memory_pool.uid_to_buffer_id:
        manager.fetch_new_loras({lora_id})
    slot = manager.memory_pool.uid_to_buffer_id[lora_id]
    plan = plan_slots(manager, spec, specs, lora_id, slot)
    log.info("refit: adapter %r (lora_id %s) in SGLang LoRA slot %d: %d tensors, %d pieces", spec.name, lora_id,
             slot, len(specs), len(plan.pieces))
    return plan


def _add_zero_adapter(manager: Any, spec: LoraSpec, specs: tuple[TensorSpec, ...]) -> str:
    from sglang.srt.lora.lora_registry import LoRARef

    slots = manager.max_loras_per_batch
    if manager.num_pinned_loras >= slots - 1:
        pinned = sorted(ref.lora_name for ref in manager.lora_refs.values() if ref.pinned)
        raise PlanError(f"refit adapter {spec.name!r}: no LoRA slot left: SGLang keeps one of its {slots} "
                        f"(max_loras_per_batch) unpinned and {pinned} are pinned; start SGLang with "
                        f"--max-loras-per-batch >= {len(pinned) + 2}")
    ref = LoRARef(lora_name=spec.name, lora_path=f"refit://{spec.name}", pinned=True)
    zeros = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    result = manager.load_lora_adapter_from_tensors(ref, zeros, _config_dict(spec))
    if not result.success:
        raise PlanError(f"refit adapter {spec.name!r}: SGLang refuses it: {result.error_message}")
    return ref.lora_id


# -- where the bytes land: SGLang's own adapter normalization and pool loader, traced on meta ------


class _PoolSwap(TensorSwap):
    """Swaps the pool's slot buffers for meta copies (plain list entries, not parameters), and back."""

    def __init__(self, manager: Any) -> None:
        super().__init__(manager.base_model)
        self.pool = manager.memory_pool
        self.live: list[tuple[list[torch.Tensor], int, torch.Tensor]] = []

    def __enter__(self) -> _PoolSwap:
        super().__enter__()
        for buffer in BUFFERS:
            for module, tensors in getattr(self.pool, buffer).items():
                for layer, tensor in enumerate(tensors):
                    self.live.append((tensors, layer, tensor))
                    tensors[layer] = self.register(f"{buffer}.{module}", str(layer), tensor, meta_copy(tensor),
                                                   restored=False, load_numel=tensor.numel())
        return self

    def _swap_module(self, mod_name: str, module: torch.nn.Module, live_params: dict, live_buffers: dict) -> bool:
        return False

    def __exit__(self, *exc: object) -> None:
        for tensors, layer, tensor in reversed(self.live):
            tensors[layer] = tensor
        self.live.clear()
        super().__exit__(*exc)


class _PoolLoad:
    """A stand-in model whose ``load_weights`` puts the traced adapter tensors into a fresh SGLang
    ``LoRAAdapter`` (its own stacking) and hands it to the pool's ``load_lora_weight_to_buffer``."""

    def __init__(self, manager: Any, lora_id: str, slot: int) -> None:
        self.manager, self.lora_id, self.slot = manager, lora_id, slot

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.layers.utils import get_layer_id
        from sglang.srt.lora.lora import LoRAAdapter

        m = self.manager
        adapter = LoRAAdapter(self.lora_id, m.configs[self.lora_id], m.base_hf_config, m.load_config,
                              m.lora_backend, base_model=m.base_model)
        for name, tensor in weights:
            adapter.layers[get_layer_id(name)].weights[name] = tensor
        adapter._normalize_weights()
        m.memory_pool.load_lora_weight_to_buffer(self.lora_id, self.slot, adapter, m.lora_modules,
                                                 m.embed_tokens_module, m.lm_head_module)


def _phantoms(manager: Any, spec: LoraSpec) -> tuple[TensorSpec, ...]:
    """Zero members of stacked groups the adapter does not target (SGLang stacks zeros in their place,
    written at registration and never by refit), so the traced stacking sees only checkpoint tensors."""
    stacked = {m for members in FUSED.values() if any(t in members for t in spec.targets) for m in members}
    return _module_specs(manager, spec.rank, lambda module: module.rsplit(".", 1)[-1] in stacked
                         and not spec.targets_module(module))


def plan_slots(manager: Any, spec: LoraSpec, specs: tuple[TensorSpec, ...], lora_id: str, slot: int) -> PoolPlan:
    """Run SGLang's adapter stacking and pool loader for ``slot`` on meta tensors and record where each
    box of each adapter tensor lands; :class:`~refit_core.PlanError` if SGLang does anything but box copies."""
    phantoms = _phantoms(manager, spec)
    trace = trace_loads(_PoolLoad(manager, lora_id, slot), [*specs, *phantoms],  # type: ignore[arg-type]
                        swap=lambda _: _PoolSwap(manager))
    if trace.rejected:
        name, why = next(iter(trace.rejected.items()))
        raise PlanError(f"refit adapter mode: SGLang's LoRA pool refuses {name}: {why}")
    if trace.opaque:
        (buffer, layer), why = next(iter(trace.opaque.items()))
        raise PlanError(f"refit adapter mode: SGLang's LoRA pool writes {buffer}[{layer}] with {why}; refit writes "
                        "only box copies")
    by_name = {s.name: s for s in specs}
    pieces = []
    for w in trace.writes:
        if w.hf_name in by_name:
            buffer, module = w.target[0].split(".", 1)
            pieces.append(SlotPiece(spec=by_name[w.hf_name], box=w.hf_box, offset=w.offset, strides=w.strides,
                                    buffer=buffer, module=module, layer=int(w.target[1])))
    unwritten = sorted(set(by_name) - {p.spec.name for p in pieces})
    if unwritten:
        raise PlanError(f"refit adapter mode: SGLang's LoRA pool holds nothing of {unwritten[0]} "
                        f"({len(unwritten)} adapter tensor(s) not placed)")
    return PoolPlan(slot=slot, specs=specs, pieces=tuple(pieces), lora_id=lora_id)


__all__ = ["AdapterTarget", "PoolPlan", "SlotPiece", "adapter_specs", "plan_slots", "register", "registered_id"]
