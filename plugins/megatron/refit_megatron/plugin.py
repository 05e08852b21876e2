"""The refit hooks of the ``megatron`` backend (entry point ``refit: megatron``).

Models are selected by type: a :class:`~refit_megatron.source.MegatronSource` (a megatron-core
``GPTModel`` or its VPP chunks, with the HF config they correspond to). Every other model gets
None, so other plugins answer. Metadata layouts (``refit plan --train megatron:tp=..``) come from
:mod:`refit_megatron.layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refit_core import Backend, ParallelLayout, Side, SourcePiece, hookimpl
from refit_core.apps import DemoPrograms

from .layout import layout_pieces
from .source import MegatronSource, live_pieces, model_tensors

BACKEND = "megatron"


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(BACKEND, frozenset({Side.TRAIN}),
                     description="megatron-core GPTModel / MambaModel trainers (TP, PP, VPP, EP, expert-TP, DP)"))


@hookimpl
def refit_register_demos(register: Callable[[DemoPrograms], None]) -> None:
    from .demo import DEFAULT_TRAIN_LAYOUT, demo_train

    register(DemoPrograms(BACKEND, train=demo_train, train_layout=DEFAULT_TRAIN_LAYOUT, priority=5))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    if not isinstance(model, MegatronSource):
        return None
    return live_pieces(model)


@hookimpl
def refit_model_tensors(model: Any) -> list[tuple[str, torch.Tensor]] | None:
    if not isinstance(model, MegatronSource):
        return None
    return model_tensors(model)


@hookimpl
def refit_source_layout(backend: str, config: dict, layout: ParallelLayout, rank: int) -> list[SourcePiece] | None:
    if backend != BACKEND:
        return None
    return layout_pieces(config, layout, rank)
