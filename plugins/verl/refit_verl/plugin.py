"""The refit backend ``verl`` (entry point ``refit: verl``): verl's FSDP2 training engines as sources.

A ``verl.workers.engine`` FSDP engine is claimed whole: its module's DTensor shards (refit-plugin-dtensor's
pieces, never ``full_tensor()``), a PEFT module's adapters in adapter mode, merged on the way with
``lora.merge``. Metadata-only layouts are the FSDP2 / HSDP layouts verl's FSDP engine builds (``fsdp``,
``dp``); tensor, pipeline and expert parallelism belong to verl's Megatron engine, refused here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from refit_core import Backend, ParallelLayout, PluginError, Side, SourcePiece, hookimpl

from .sources import is_training_engine, source_model

BACKEND = "verl"
_SHARDED_BY = ("fsdp", "dp")


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(BACKEND, {Side.TRAIN},
                     description="verl's FSDP2 actor (a verl training engine), its DTensor shards read in place"))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    if not is_training_engine(model):
        return None
    from refit_dtensor import plugin as dtensor

    pieces = dtensor.refit_source_pieces(source_model(model))
    if pieces is None:
        raise PluginError(f"verl actor: {type(model.module).__name__} is not a transformers model refit can read")
    return pieces


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
