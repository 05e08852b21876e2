"""Rank programs for the relay tests: one toy train rank, gen ranks that are whole toy engines
(one replica each), train rank first."""

from __future__ import annotations

import os

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.verify import mismatches
from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer


def relay_ranks(rank: int, world: int, address: str, steps: int, relay: dict, die_after_setup: int | None = None,
                timeout_s: float = 30) -> dict | tuple:
    """Run one rank; returns what it saw per step, or ``("error", type, message, torn)``."""
    options = RefitOptions(timeout_s=timeout_s, relay=relay)
    endpoint: RefitSender | RefitReceiver
    try:
        if rank == 0:
            trainer = ToyTrainer(0, 1)
            endpoint = RefitSender(trainer, rendezvous=address, rank=0, world_size=1, options=options)
        else:
            engine = ToyEngine(0, 1)  # every gen rank is a whole replica: identical layouts
            endpoint = RefitReceiver(engine, rendezvous=address, rank=rank - 1, world_size=world - 1,
                                     options=options)
        schedule = endpoint.setup()
        if die_after_setup == rank:
            os._exit(0)
        out: dict = {"fingerprint": schedule.fingerprint, "steps": [],
                     "train_peers": sorted({m.dst for msgs in schedule.rounds for m in msgs}),
                     "waves": endpoint.relay.waves.waves if endpoint.relay else None,
                     "relay_messages": endpoint.relay.schedule.summary.messages if endpoint.relay else 0}
        for step in range(steps):
            if rank == 0:
                trainer.load(reference(0, step))
                endpoint.send(version=100 + step)
            else:
                stats = endpoint.receive()
                assert isinstance(endpoint, RefitReceiver)
                pieces = endpoint.plugins.destination_map(engine).pieces
                out["steps"].append({"version": stats.version, "engine_version": engine.version,
                                     "mismatches": mismatches(pieces, reference(0, step))})
        times = endpoint.setup_times
        out["setup"] = times.to_json() if times else None
        endpoint.close()
        return out
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        torn = list(getattr(getattr(exc, "failure", None), "torn", ()))
        return ("error", type(exc).__name__, str(exc), torn)
