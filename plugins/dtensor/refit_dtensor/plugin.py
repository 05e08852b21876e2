"""The refit hooks of the ``dtensor`` backend (entry point ``refit: dtensor``).

Models are selected by type: a ``transformers.PreTrainedModel``, bare or inside torch.compile /
activation-checkpoint / DDP wrappers, sharded with any DTensor placements or not at all. Every
other model (a vLLM or Megatron module, for instance) gets None, so other plugins answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from refit_core import (
    Backend,
    DestinationMap,
    DestinationPiece,
    ParallelLayout,
    PluginError,
    Side,
    SourcePiece,
    hookimpl,
)
from refit_core.apps import DemoPrograms
from refit_core.kit import refuse_serving, resume_serving

from .layout import layout_pieces
from .lora import inner_model, lora_pieces, peft_of
from .names import clean_name, tied_targets, unwrap
from .shards import model_pieces, model_tensors, reshard

BACKEND = "dtensor"

_untied: weakref.WeakKeyDictionary[Any, list[tuple[Any, Any]]] = weakref.WeakKeyDictionary()
"""Destination models whose config ties parameters that sharding split apart: (copy, original)."""


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(
        BACKEND, {Side.TRAIN, Side.GEN},
        description="PyTorch DTensor / FSDP2 / tensor-parallel transformers models (source and destination)",
    ))


@hookimpl
def refit_register_demos(register: Callable[[DemoPrograms], None]) -> None:
    from .demo import DEFAULT_GEN_LAYOUT, DEFAULT_TRAIN_LAYOUT, demo_gen, demo_train

    register(DemoPrograms(
        BACKEND, train=demo_train, gen=demo_gen, train_layout=DEFAULT_TRAIN_LAYOUT, gen_layout=DEFAULT_GEN_LAYOUT,
        priority=10, quantize={"fp8"}, rl_train_actor="refit_dtensor.policy:FSDPPolicyActor",
    ))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    if peft_of(model) is not None:
        return lora_pieces(model, SourcePiece)
    if unwrap(model) is None:
        return None
    return model_pieces(model, SourcePiece)


@hookimpl
def refit_model_tensors(model: Any) -> list[tuple[str, torch.Tensor]] | None:
    if peft_of(model) is not None or unwrap(model) is None:
        return None  # a PeftModel: refit compares its adapter pieces before every step
    return model_tensors(model)


@hookimpl
def refit_destination_map(model: Any) -> DestinationMap | None:
    if peft_of(model) is not None:
        return DestinationMap(lora_pieces(model, DestinationPiece))
    hf = unwrap(model)
    if hf is None:
        return None
    _untied[hf] = _broken_ties(hf)
    return DestinationMap(model_pieces(model, DestinationPiece))


@hookimpl
def refit_begin_update(model: Any) -> bool | None:
    hf = _hf(model)
    if hf is None:
        return None
    reshard(hf)  # drop FSDP2's all-gathered copies: the next forward gathers the new weights
    return False


@hookimpl
def refit_finish_update(model: Any, version: int) -> bool | None:
    hf = _hf(model)
    if hf is None:
        return None
    for copy, original in _untied.get(hf, ()):
        if isinstance(copy, DTensor):
            copy.to_local().detach().copy_(original.to_local().detach())
        else:
            copy.detach().copy_(original.detach())
    resume_serving(hf)
    return True


@hookimpl
def refit_abort_update(model: Any, torn: list[str]) -> bool | None:
    """A failed in-place step: the module keeps no second copy, so it refuses to serve (its forward
    raises) until a refit succeeds; in staged mode ``torn`` is empty and nothing changed."""
    hf = _hf(model)
    if hf is None:
        return None
    if torn:
        refuse_serving(hf, torn)
    return True


@hookimpl
def refit_source_layout(backend: str, config: dict, layout: ParallelLayout, rank: int) -> list[SourcePiece] | None:
    if backend != BACKEND:
        return None
    return layout_pieces(SourcePiece, config, layout, rank)


@hookimpl
def refit_destination_layout(backend: str, config: dict, layout: ParallelLayout, rank: int) -> DestinationMap | None:
    if backend != BACKEND:
        return None
    return DestinationMap(layout_pieces(DestinationPiece, config, layout, rank))


def _broken_ties(hf: Any) -> list[tuple[Any, Any]]:
    """Tied parameters that sharding made separate tensors (TP on a tied embedding): the copy is
    refreshed from the original after every refit, which needs identical local layouts."""
    ties = tied_targets(hf)
    if not ties:
        return []
    params = {clean_name(n): p for n, p in hf.named_parameters(remove_duplicate=False)}
    broken = []
    for target, source in ties.items():
        copy, original = params.get(target), params.get(source)
        if copy is None or original is None or copy is original:
            continue
        same = (type(copy) is type(original) and copy.shape == original.shape
                and (not isinstance(copy, DTensor)
                     or (copy.device_mesh == original.device_mesh and copy.placements == original.placements)))
        if not same:
            raise PluginError(f"{target} is tied to {source} in the config but sharded differently "
                              f"({getattr(copy, 'placements', 'plain')} vs "
                              f"{getattr(original, 'placements', 'plain')}): "
                              "refit cannot keep the copy in sync; shard them alike or untie them")
        broken.append((copy, original))
    return broken


def _hf(model: Any) -> Any | None:
    """The transformers model ``model`` is or holds (inside a PeftModel too), or None."""
    peft = peft_of(model)
    return unwrap(model) if peft is None else inner_model(peft)
