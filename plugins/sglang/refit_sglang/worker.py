"""The receiver inside SGLang's TP workers: a custom weight loader that runs one refit step.

SGLang calls it from ``WeightUpdater.update_weights_from_tensor`` (``model_runner``) when a trainer
calls ``update_weights_from_tensor(..., load_format="refit_sglang.worker.receive")`` inside a weight
update session. The first ticket of a session sets up a :class:`refit_core.RefitReceiver` for the
worker's model (collective with the trainer's ``RefitSender.setup()``); every ticket then lands one
weight version straight into the model's fused parameters while the trainer's ranks send it.
SGLang runs its own ``begin_weight_update`` before (restores packed weights) and
``end_weight_update`` after (re-applies post-load processing); ``flush_cache`` and ``weight_version``
are handled by SGLang's scheduler around this call.

A failed step never raises into SGLang: its scheduler does not catch exceptions from custom loaders,
so an exception would take the whole engine down (sglang 0.5.23, ``Scheduler.process_input_requests``).
The error is logged, kept for :func:`last_error`, and the worker's receiver is dropped so the next
ticket sets up afresh. The trainer learns of it through refit itself: setup and transfer errors
are raised on every rank of both sides, so its ``RefitSender`` raises (and the client with it).
After every step the TP workers agree whether the engine may serve (:mod:`refit_sglang.serving`):
where a worker's weights are torn or unconfirmed, or the workers' versions differ, the model's
forward raises until a step lands on every worker; :func:`rank_state` shows a worker's state.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from refit_core import RefitError, RefitReceiver
from refit_core.kit import own_rank_state, refuse_engine

from . import serving
from .serving import Exchange, sglang_exchange
from .state import state_of
from .ticket import RefitTicket

log = logging.getLogger("refit.sglang")

_receivers: weakref.WeakKeyDictionary[torch.nn.Module, tuple[RefitTicket, RefitReceiver]] = \
    weakref.WeakKeyDictionary()
_errors: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_states: weakref.WeakKeyDictionary[torch.nn.Module, serving.RankState] = weakref.WeakKeyDictionary()


def sglang_tp_rank() -> int:
    """This worker's TP rank, as SGLang's ``update_weights_from_tensor`` reads it."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank


def receive(model: torch.nn.Module, named_tensors: Any, *, tp_rank: Callable[[], int] = sglang_tp_rank,
            exchange: Exchange = sglang_exchange) -> None:
    """SGLang custom weight loader: land the weight version the ticket in ``named_tensors`` announces.

    On failure (a malformed ticket, a setup or transfer error, another version than announced) the
    error is logged and kept for :func:`last_error` instead of raised (see the module docstring).
    Either way the TP workers then ``exchange`` their states and agree whether the engine may serve
    (:mod:`refit_sglang.serving`): where a worker needs a refit or the versions differ, the model's
    forward raises until a step lands on every worker.
    """
    _errors.pop(model, None)
    rank = tp_rank()
    receiver: RefitReceiver | None = None
    failed: str | None = None
    try:
        ticket = RefitTicket.parse(named_tensors)
        rank += ticket.rank_offset
        receiver = _receiver_for(model, ticket, tp_rank())
        stats = receiver.receive()
        if stats.version != ticket.version:
            raise RefitError(f"the trainer announced weight version {ticket.version} but sent {stats.version}")
    except Exception as exc:  # noqa: BLE001 - SGLang's scheduler must survive a failed step
        failed = f"{type(exc).__name__}: {exc}"
    refused = _agree(model, rank, receiver, exchange)
    if refused is not None:
        failed = refused if failed is None else f"{refused}. This worker's step failed: {failed}"
    if failed is not None:
        _errors[model] = failed
        close(model)
        log.error("refit: weight update failed in this SGLang TP worker (the trainer's ranks get the error "
                  "too): %s", failed)
        return
    log.info("refit: SGLang TP rank %d landed weight version %d", receiver.rank - ticket.rank_offset,
             stats.version)


def _agree(model: torch.nn.Module, rank: int, receiver: RefitReceiver | None, exchange: Exchange) -> str | None:
    """This worker's state, exchanged with its TP peers; refuse or resume serving by all of them."""
    held = state_of(model)
    version = None if held is None else held.version
    mine = own_rank_state(receiver, model, rank=rank, version=version)
    _states[model] = mine
    try:
        return serving.settle(exchange(mine), model)
    except Exception as exc:  # noqa: BLE001 - a worker that cannot hear its peers must not serve
        message = (f"engine refuses to serve: gen rank {rank} could not learn its TP peers' weight versions "
                   f"({type(exc).__name__}: {exc}); refit again")
        refuse_engine(model, message)
        return message


def rank_state(model: torch.nn.Module) -> serving.RankState | None:
    """This worker's state (gen rank, version, why it needs a refit) as its last step left it; None
    before any step."""
    return _states.get(model)


def last_error(model: torch.nn.Module) -> str | None:
    """Why the last :func:`receive` into ``model`` failed, or None if it succeeded (or never ran)."""
    return _errors.get(model)


def _receiver_for(model: torch.nn.Module, ticket: RefitTicket, tp_rank: int) -> RefitReceiver:
    known = _receivers.get(model)
    if known is not None and known[0].session == ticket.session:
        return known[1]
    if known is not None:
        known[1].close()
        del _receivers[model]
    receiver = RefitReceiver(model, rendezvous=ticket.rendezvous, rank=ticket.rank_offset + tp_rank,
                             world_size=ticket.world_size, options=ticket.options())
    receiver.setup()
    _receivers[model] = (ticket, receiver)
    return receiver


def close(model: torch.nn.Module) -> None:
    """Release the refit receiver of ``model`` (its transport and rendezvous connection), if any."""
    known = _receivers.pop(model, None)
    if known is not None:
        known[1].close()
