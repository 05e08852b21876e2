"""PEFT LoRA models (``peft.get_peft_model`` on a ``transformers`` model, DTensor / FSDP2 sharded or not).

Two ways to refit one (:class:`~refit_core.LoraMode`):

- **adapter** (a bare ``PeftModel``): the pieces are the adapter's ``lora_A`` / ``lora_B`` weights, at
  the trainer's sharding, under PEFT adapter-checkpoint names without ``base_model.model.``
  (``model.layers.0.self_attn.q_proj.lora_A.weight``); everything else stays where it is. A
  ``PeftModel`` is also an adapter-mode destination (its adapter weights are written in place).
- **merged** (``merged(peft_model)``): the pieces are the base model's HF checkpoint tensors (no
  ``base_model.model.`` / ``.base_layer``); those of adapted modules are
  :class:`~refit_core.MergedSourcePiece`, and the sender adds ``scale * B @ A`` to each box it packs,
  from the adapters gathered once per step (:class:`DTensorAdapters`).

Refused with a :class:`~refit_core.PlanError` naming what: DoRA, rsLoRA, per-module ranks or alphas
(``rank_pattern`` / ``alpha_pattern``), ``modules_to_save``, ``lora_bias``, ``fan_in_fan_out``, LoRA on
anything but ``nn.Linear``, and several adapters. Dropout changes no weight and is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from refit_core import (
    Box,
    LoraFactors,
    LoraMerge,
    LoraMode,
    LoraSpec,
    MergedSourcePiece,
    PlanError,
    SourcePiece,
    adapter_tensor_names,
)

from .fp8 import quantization_of
from .names import Naming, Target, named_parameters, unwrap
from .placements import tensor_blocks
from .shards import P, param_pieces, reshard


BASE_LAYER = ".base_layer"


@dataclass(frozen=True)
class Merged:
    """A PEFT model to refit in merged mode (made by :func:`merged`)."""

    model: Any


def merged(peft_model: Any) -> Merged:
    """Refit ``peft_model`` in merged mode: the engine receives ``W + scale * B @ A`` as plain weights."""
    if peft_of(peft_model) is None:
        raise PlanError(f"merged() takes a peft.PeftModel, got {type(peft_model).__qualname__}")
    return Merged(peft_model)


def peft_of(model: Any) -> Any | None:
    """The ``peft.PeftModel`` ``model`` is (or wraps in :class:`Merged`), or None."""
    if isinstance(model, Merged):
        model = model.model
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional: without it no model is a PEFT model
        return None
    return model if isinstance(model, PeftModel) else None


def mode_of(model: Any) -> LoraMode:
    return LoraMode.MERGED if isinstance(model, Merged) else LoraMode.ADAPTER


def inner_model(peft_model: Any) -> Any:
    """The ``transformers`` model inside a ``PeftModel`` (its modules carry the LoRA layers)."""
    hf = unwrap(peft_model.base_model.model)
    if hf is None:
        raise PlanError(f"{type(peft_model.base_model.model).__qualname__} inside the PeftModel is not a "
                        "transformers PreTrainedModel")
    return hf


_REFUSED = (
    ("use_dora", "DoRA (use_dora=True) rescales the merged weight per column: refit merges plain LoRA only"),
    ("use_rslora", "rsLoRA (use_rslora=True) scales by alpha/sqrt(r): refit moves plain LoRA only"),
    ("modules_to_save", "modules_to_save trains full copies of modules that refit would not move"),
    ("rank_pattern", "per-module ranks (rank_pattern): refit's adapters have one rank"),
    ("alpha_pattern", "per-module alphas (alpha_pattern): refit's adapters have one alpha"),
    ("lora_bias", "lora_bias adds a trained bias to lora_B that refit would not move"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D weights stored transposed) is not supported"),
)


def lora_spec(peft_model: Any) -> LoraSpec:
    """The adapter of ``peft_model`` (its only one) as a :class:`~refit_core.LoraSpec`; a
    :class:`~refit_core.PlanError` naming the setting refit cannot move."""
    configs = dict(peft_model.peft_config)
    if len(configs) != 1:
        raise PlanError(f"the PeftModel holds {len(configs)} adapters {sorted(configs)}: refit moves exactly one")
    name, config = next(iter(configs.items()))
    if str(getattr(config, "peft_type", "LORA")).rsplit(".", 1)[-1].upper() != "LORA":
        raise PlanError(f"adapter {name!r} is {config.peft_type}, not LoRA")
    for attribute, why in _REFUSED:
        if getattr(config, attribute, None):
            raise PlanError(f"adapter {name!r}: {why}")
    targets = sorted({module.rsplit(".", 1)[-1] for module in adapted_modules(inner_model(peft_model), name)})
    if not targets:
        raise PlanError(f"adapter {name!r} adapts no module of the model")
    return LoraSpec(rank=int(config.r), alpha=float(config.lora_alpha), targets=tuple(targets), name=name,
                    mode=LoraMode.ADAPTER)


def adapted_modules(hf: nn.Module, adapter: str) -> dict[str, nn.Module]:
    """``{HF module name: PEFT LoRA layer}`` of every module ``adapter`` adapts."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear

    from .names import clean_name

    found = {}
    for name, module in hf.named_modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            if not isinstance(module, LoraLinear) or not isinstance(module.get_base_layer(), nn.Linear):
                raise PlanError(f"{clean_name(name)}: LoRA on {type(module).__qualname__} is not supported "
                                "(nn.Linear only)")
            found[clean_name(name)] = module
    return found


def _identity(name: str, shape: tuple[int, ...]) -> Target:
    return Target(name, shape, Box((0,) * len(shape), shape), tuple(range(len(shape))))


def adapter_pieces(model: Any, kind: type[P]) -> list[P]:
    """Adapter mode: the ``lora_A`` / ``lora_B`` weights this rank holds, under adapter-checkpoint names."""
    peft_model = peft_of(model)
    assert peft_model is not None
    spec = lora_spec(peft_model)
    hf = inner_model(peft_model)
    reshard(hf)
    pieces: list[P] = []
    for module, layer in adapted_modules(hf, spec.name).items():
        for name, param in zip(adapter_tensor_names(module),
                               (layer.lora_A[spec.name].weight, layer.lora_B[spec.name].weight)):
            local, blocks = tensor_blocks(param, what=name)
            pieces.extend(param_pieces(kind, [_identity(name, tuple(param.shape))], param.dtype, blocks,
                                       local.detach()))
    return pieces


class DTensorAdapters:
    """A model's adapters for merged mode: every adapted module's whole A and B, gathered each step
    (``full_tensor()`` of sharded ones: a collective over the trainer's mesh, in module order)."""

    def __init__(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = dict(layers)

    def gather(self) -> dict[str, LoraFactors]:
        return {module: LoraFactors(_whole(a), _whole(b)) for module, (a, b) in self.layers.items()}


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor().detach() if isinstance(param, DTensor) else param.detach()


def merged_pieces(model: Any) -> list[SourcePiece]:
    """Merged mode: the base model's checkpoint pieces; adapted weights as merged pieces."""
    peft_model = peft_of(model)
    assert peft_model is not None
    spec = lora_spec(peft_model)
    hf = inner_model(peft_model)
    reshard(hf)
    layers = adapted_modules(hf, spec.name)
    adapters = DTensorAdapters({module: (layer.lora_A[spec.name].weight, layer.lora_B[spec.name].weight)
                                for module, layer in layers.items()})
    merges = {f"{module}.weight": LoraMerge(module, float(layer.scaling[spec.name]), adapters)
              for module, layer in layers.items()}
    naming = Naming(hf)
    pieces: list[SourcePiece] = []
    for name, param in named_parameters(hf):
        if ".lora_" in name:
            continue
        base = name.replace(BASE_LAYER + ".", ".")
        local, blocks = tensor_blocks(param, what=base)
        made = param_pieces(SourcePiece, naming.targets(base, tuple(param.shape)), param.dtype, blocks,
                            local.detach(), quantization_of(hf, name, param))
        merge = merges.get(base)
        if merge is None:
            pieces.extend(made)
            continue
        if made and made[0].spec.quant is not None:
            raise PlanError(f"{merge.module}: merged LoRA on a quantized base weight is not supported")
        pieces.extend(MergedSourcePiece(p.spec, p.box, p.view, merge=merge) for p in made)
    return pieces


def lora_pieces(model: Any, kind: type[P]) -> list[P] | list[SourcePiece]:
    """The pieces of a PEFT model in its mode (merged mode is a source only)."""
    if mode_of(model) is LoraMode.MERGED:
        if not issubclass(kind, SourcePiece):
            raise PlanError("merged(peft_model) is a refit source only; a destination of merged weights is the "
                            "plain model")
        return merged_pieces(model)
    return adapter_pieces(model, kind)
