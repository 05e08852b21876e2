"""Rank programs for the relay tests: toy train ranks first, then toy engine ranks (whole engines,
one replica each, or one engine sharded over ``engine_ranks`` ranks)."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.kit.verify import mismatches
from refit_core.run.timing import Timeline


def relay_ranks(rank: int, world: int, address: str, steps: int, relay: dict, die_after_setup: int | None = None,
                timeout_s: float = 30, train_ranks: int = 1, engine_ranks: int = 1, options: dict | None = None,
                record: bool = False, cuda: bool = False, stall_after_setup: int | None = None) -> dict | tuple:
    """Run one rank; returns what it saw per step, or ``("error", type, message, torn)``.

    ``engine_ranks`` 1: every gen rank is a whole engine (identical replicas); above 1, the gen ranks
    are one engine, sharded (its fused ``qkv`` and norm replicated on every rank). ``options``: more
    RefitOptions; ``record``: each step's spans (gen ranks) and the transport's counters (every rank);
    ``cuda``: every rank on a GPU of its own (``cuda:<global rank>``, over NCCL). ``die_after_setup`` /
    ``stall_after_setup``: that global rank exits, or hangs past the deadline, once set up."""
    options = RefitOptions(timeout_s=timeout_s, relay=relay, **(options or {}))
    endpoint: RefitSender | RefitReceiver
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    try:
        if rank < train_ranks:
            trainer = ToyTrainer(rank, train_ranks, device=device)
            endpoint = RefitSender(trainer, rendezvous=address, rank=rank, world_size=train_ranks, options=options)
        else:
            gen_rank = rank - train_ranks
            engine = ToyEngine(gen_rank % engine_ranks, engine_ranks, device=device)
            endpoint = RefitReceiver(engine, rendezvous=address, rank=gen_rank, world_size=world - train_ranks,
                                     options=options)
        schedule = endpoint.setup()
        if die_after_setup == rank:
            os._exit(0)
        if stall_after_setup == rank:  # hung, its connections open: only the deadline can tell
            time.sleep(timeout_s + 2)
            os._exit(0)
        out: dict = {"fingerprint": schedule.fingerprint, "steps": [],
                     "train_peers": sorted({m.dst for msgs in schedule.rounds for m in msgs}),
                     "train_bytes": sum(m.nbytes for msgs in schedule.rounds for m in msgs),
                     "levels": endpoint.relay.tree.levels if endpoint.relay else None,
                     "relay_messages": endpoint.relay.schedule.summary.messages if endpoint.relay else 0,
                     "relay_pairs": sorted({(m.src, m.dst) for msgs in endpoint.relay.schedule.rounds for m in msgs})
                     if endpoint.relay and rank >= train_ranks else []}
        if record:
            endpoint.timeline = Timeline(torch.device(device))
            out["timelines"], out["counters"] = [], []
        for step in range(steps):
            if rank < train_ranks:
                trainer.load(reference(0, step))
                endpoint.send(version=100 + step)
            else:
                stats = endpoint.receive()
                assert isinstance(endpoint, RefitReceiver)
                pieces = endpoint.plugins.destination_map(engine).pieces
                out["steps"].append({"version": stats.version, "engine_version": engine.version,
                                     "mismatches": mismatches(pieces, reference(0, step))})
            if record:
                counters = endpoint.transport.counters if endpoint.transport is not None else None
                out["counters"].append(dataclasses.asdict(counters) if counters is not None else None)
                timeline = endpoint.last_timeline
                out["timelines"].append([(s.phase.value, s.round, s.start, s.end) for s in timeline.spans]
                                        if timeline is not None else None)
        times = endpoint.setup_times
        out["setup"] = times.to_json() if times else None
        endpoint.close()
        return out
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        torn = list(getattr(getattr(exc, "failure", None), "torn", ()))
        return ("error", type(exc).__name__, str(exc), torn)
