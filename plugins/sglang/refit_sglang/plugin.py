"""refit's hooks for SGLang (entry point ``refit: sglang``).

The hooks select themselves only for SGLang model classes (``sglang.srt.models.*``, the ``nn.Module``
of one TP worker's model runner) and for the backend name ``"sglang"``. Importing this module does
not import SGLang.

In a running engine these hooks are driven from inside SGLang's own weight-update session: the
trainer opens it (``begin_weight_update``), calls ``update_weights_from_tensor`` with refit's
custom loader (:func:`refit_sglang.worker.receive`), which runs one refit step in every TP worker,
and closes it (``end_weight_update``, where SGLang re-applies its post-load processing).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from refit_core import Backend, DestinationMap, DestinationPiece, ParallelLayout, RefitError, Side, hookimpl

from .state import state_of

log = logging.getLogger("refit.sglang")

BACKEND = "sglang"


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(BACKEND, {Side.GEN}, "SGLang model classes: fused qkv/gate_up/w13/w2 written in place, "
                     "driven by SGLang's weight-update session; loader path for the rest"))


@hookimpl
def refit_destination_map(model: Any) -> DestinationMap | None:
    state = state_of(model)
    if state is None:
        return None
    from .probe import live_views, planned, storages

    plan = planned(model, state)
    views = live_views(model, plan)
    state.storages = storages(model, plan)
    return DestinationMap(pieces=[DestinationPiece(p.spec, p.box, v) for p, v in zip(plan.pieces, views)],
                          loader=list(plan.loader))


@hookimpl
def refit_begin_update(model: Any) -> bool | None:
    """True when SGLang re-materialized a fast-path tensor since its views were handed out (then
    refit asks for the views again), False when they stay valid. The padding SGLang's loaders
    write (zeroed vocab rows) is written before the first update and after every re-materialization:
    a model whose weights never went through ``load_weights`` may hold anything there. (An adapter,
    :class:`~refit_sglang.lora.AdapterTarget`, is the core's: ``refit_core.contract.defaults``.)"""
    state = state_of(model)
    if state is None:
        return None
    if state.updating:
        raise RefitError("refit_begin_update called twice without refit_finish_update")
    from .probe import planned, storages, write_padding

    plan = planned(model, state)
    moved = storages(model, plan) != state.storages
    if moved or not state.padded:
        write_padding(model, plan)
        state.padded = True
    state.updating = True
    return moved


@hookimpl
def refit_load_weights(model: Any, weights: list[tuple[str, torch.Tensor]]) -> bool | None:
    state = state_of(model)
    if state is None:
        return None
    with torch.no_grad():
        model.load_weights(iter(weights))
    return True


@hookimpl
def refit_finish_update(model: Any, version: int) -> bool | None:
    """Run the model's post-load fix-up (SGLang skips it when a load ran; refit's fast path
    bypassed ``load_weights``) and record ``version``."""
    state = state_of(model)
    if state is None:
        return None
    post_load = getattr(model, "post_load_weights", None)
    if callable(post_load):
        with torch.no_grad():
            post_load()
    state.updating = False
    state.version = version
    return True


@hookimpl
def refit_abort_update(model: Any, torn: list[str]) -> bool | None:
    """False: SGLang's parameters are written in place and the previous weights are gone (as with
    SGLang's own ``update_weights_from_distributed``); the engine must get a complete refit next
    (``torn`` names what the step may have written; empty in staged mode, where nothing changed)."""
    state = state_of(model)
    if state is None:
        return None
    if state.updating:
        log.error("refit: a step failed midway: SGLang model %s holds partly updated weights until the "
                  "next complete refit", type(model).__name__)
    state.updating = False
    return False


@hookimpl
def refit_destination_layout(backend: str, config: dict[str, Any], layout: ParallelLayout,
                             rank: int) -> DestinationMap | None:
    if backend != BACKEND:
        return None
    from .layout import destination_layout

    return destination_layout(config, layout, rank)
