"""Rank programs of the transport tests: a toy refit (train ranks first, then gen ranks) over a named
transport, reporting what each rank saw."""

from __future__ import annotations

import time

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.kit.verify import mismatches

TRAIN_RANKS = 2


def toy_refit(rank: int, world: int, address: str, steps: int, train_options: dict, gen_options: dict) -> dict:
    """One rank of a toy refit of ``steps`` steps: its side, the transport it ran on (kind and options) and,
    on gen ranks, each step's mismatches against the reference; or the error that ended it and when."""
    train = rank < TRAIN_RANKS
    local, size = (rank, TRAIN_RANKS) if train else (rank - TRAIN_RANKS, world - TRAIN_RANKS)
    options = RefitOptions(**(train_options if train else gen_options))
    start = time.monotonic()
    endpoint: RefitSender | RefitReceiver
    try:
        if train:
            model = ToyTrainer(local, size)
            endpoint = RefitSender(model, rendezvous=address, rank=local, world_size=size, options=options)
        else:
            model = ToyEngine(local, size)
            endpoint = RefitReceiver(model, rendezvous=address, rank=local, world_size=size, options=options)
        endpoint.setup()
        transport = endpoint.transport
        seen = {"kind": getattr(transport, "kind", None), "options": repr(getattr(transport, "options", None))}
        steps_seen = []
        for step in range(steps):
            if isinstance(endpoint, RefitSender):
                model.load(reference(0, step))
                endpoint.send(version=100 + step)
            else:
                endpoint.receive()
                pieces = endpoint.plugins.destination_map(model).pieces
                steps_seen.append({"mismatches": mismatches(pieces, reference(0, step)), "version": model.version})
        registered = getattr(transport, "registered_bytes", None)  # what the executor handed register()
        direct = endpoint.executor.direct_bytes if steps else None  # the bytes it sends or lands zero-copy
        endpoint.close()
        return {"side": "train" if train else "gen", "steps": steps_seen, "registered": registered, "direct": direct,
                **seen}
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
