"""Rank programs for the refusal tests: a toy refit whose trainers call ``send()`` wrongly (a version that
goes backwards or is out of range, a subset naming a tensor the plan does not move), each call followed by
a new setup on the same address, as a user would after a failed step."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fault_ranks import _state_against
from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender


@dataclass(frozen=True)
class Call:
    """One ``send()`` of every train rank (each gen rank calls ``receive()``): the reference weights it
    loads, the version, ``only`` and ``reset``."""

    weights: int
    version: int
    only: tuple[str, ...] | None = None
    reset: bool = False


def refusal_rank(rank: int, report, address: str, train: int, gen: int, calls: tuple[Call, ...],
                 options: dict) -> list[dict]:
    """Rank ``rank`` (train ranks first) makes ``calls`` in order; after a failed one it closes and sets up
    again on the same address. Per call: the error (type, message, seconds) or, on a gen rank, whether it
    holds that call's weights bitwise, and its version."""
    is_train = rank < train
    local, size = (rank, train) if is_train else (rank - train, gen)
    model = ToyTrainer(local, size) if is_train else ToyEngine(local, size)
    endpoint = (RefitSender if is_train else RefitReceiver)(model, rendezvous=address, rank=local, world_size=size,
                                                            options=RefitOptions(**options))
    endpoint.setup()
    out = []
    for call in calls:
        start = time.monotonic()
        try:
            if isinstance(endpoint, RefitSender):
                model.load(reference(0, call.weights))
                endpoint.send(call.version, only=call.only, reset=call.reset)
                out.append({"ok": True})
            else:
                endpoint.receive(only=call.only)
                out.append({"ok": True, "version": endpoint.version,
                            "bitwise": _state_against(model, endpoint, call.weights)})
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start})
            try:
                endpoint.setup()  # closes what is left first
            except Exception as again:  # noqa: BLE001 - the test inspects it
                out.append({"error": type(again).__name__, "message": f"setting up again: {again}", "seconds": 0})
                break
    endpoint.close()
    return out
