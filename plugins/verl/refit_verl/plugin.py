"""The refit backend ``verl`` (entry point ``refit: verl``): verl's training engines as sources.

A ``verl.workers.engine`` FSDP engine is claimed whole: its module's DTensor shards (refit-plugin-dtensor's
pieces, never ``full_tensor()``), a PEFT module's adapters in adapter mode, merged on the way with
``lora.merge``. A Megatron engine's tensor / pipeline / expert shards are refit-plugin-megatron's pieces
(:mod:`refit_verl.megatron`). Metadata-only layouts are the FSDP2 / HSDP layouts verl's FSDP engine builds
(``fsdp``, ``dp``); a Megatron engine's layouts are the ``megatron`` backend's (``megatron:tp=2,...``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refit_core import Backend, ParallelLayout, PluginError, Side, SourcePiece, hookimpl

from .megatron import is_megatron_engine, megatron_pieces, megatron_tensors
from .sources import is_training_engine, source_model

BACKEND = "verl"
_SHARDED_BY = ("fsdp", "dp")


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(BACKEND, {Side.TRAIN},
                     description="verl's FSDP2 or Megatron actor (a verl training engine), its shards read in place"))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    if not is_training_engine(model):
        return None
    if is_megatron_engine(model):
        return megatron_pieces(model)
    from refit_dtensor import plugin as dtensor

    pieces = dtensor.refit_source_pieces(source_model(model))
    if pieces is None:
        raise PluginError(f"verl actor: {type(model.module).__name__} is not a transformers model refit can read")
    return pieces


@hookimpl
def refit_model_tensors(model: Any) -> list[tuple[str, torch.Tensor]] | None:
    if not is_training_engine(model):
        return None
    if is_megatron_engine(model):
        return megatron_tensors(model)
    from refit_dtensor import plugin as dtensor

    return dtensor.refit_model_tensors(source_model(model))  # None for a PEFT model: its pieces are compared


@hookimpl
def refit_source_layout(backend: str, config: dict, layout: ParallelLayout, rank: int) -> list[SourcePiece] | None:
    if backend != BACKEND:
        return None
    other = {k: v for k, v in layout.given().items() if k not in _SHARDED_BY}
    if other:
        raise PluginError(f"verl's FSDP engine shards with fsdp and dp only, not {other} (Megatron: the megatron "
                          "backend)")
    from refit_dtensor.layout import layout_pieces

    return layout_pieces(SourcePiece, config, layout, rank)
