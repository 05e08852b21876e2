"""Rank programs for the multi-process core tests (train ranks first, then gen ranks)."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import weakref

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.kit.verify import mismatches, same_bytes

TRAIN_RANKS = 2


def refit_ranks(rank: int, world: int, address: str, steps: int, options: dict, overrides: dict | None = None,
                die_after_setup: int | None = None):
    """Run one rank of a toy refit. Returns per-step stats, or ``("error", type, message)``."""
    train = rank < TRAIN_RANKS
    local, size = (rank, TRAIN_RANKS) if train else (rank - TRAIN_RANKS, world - TRAIN_RANKS)
    opts = RefitOptions(**options)
    try:
        if train:
            model = ToyTrainer(local, size, shape_overrides=overrides)
            endpoint = RefitSender(model, rendezvous=address, rank=local, world_size=size, options=opts)
        else:
            model = ToyEngine(local, size)
            endpoint = RefitReceiver(model, rendezvous=address, rank=local, world_size=size, options=opts)
        schedule = endpoint.setup()
        if die_after_setup == rank:
            os._exit(0)
        results = []
        for step in range(steps):
            if train:
                model.load(reference(0, step))
                stats = endpoint.send(version=100 + step)
            else:
                stats = endpoint.receive()
                pieces = endpoint.plugins.destination_map(model).pieces
                results.append({"mismatches": mismatches(pieces, reference(0, step)), "engine_version": model.version})
            results.append({"version": stats.version, "bytes": stats.bytes, "staging": stats.staging_bytes,
                            "rounds": len(endpoint.executor.rounds)})
        endpoint.close()
        return {"side": "train" if train else "gen", "steps": results, "stats": dataclasses.asdict(schedule.summary)}
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return ("error", type(exc).__name__, str(exc))


def odd_expert_ranks(rank: int, world: int, address: str, steps: int) -> dict:
    """A refit whose experts use the toy plugin's own naming (no ``.experts.``) and, on the gen side,
    the loader path. Gen ranks return the names their engine's loader received and the mismatches."""
    train = rank < TRAIN_RANKS
    local, size = (rank, TRAIN_RANKS) if train else (rank - TRAIN_RANKS, world - TRAIN_RANKS)
    options = RefitOptions(timeout_s=30)
    if train:
        trainer = ToyTrainer(local, size, odd_experts=True)
        sender = RefitSender(trainer, rendezvous=address, rank=local, world_size=size, options=options)
        sender.setup()
        for step in range(steps):
            trainer.load(reference(0, step, odd_experts=True))
            sender.send(version=step)
        sender.close()
        return {"side": "train"}
    engine = ToyEngine(local, size, odd_experts=True)
    receiver = RefitReceiver(engine, rendezvous=address, rank=local, world_size=size, options=options)
    receiver.setup()
    out: dict = {"side": "gen", "steps": []}
    for step in range(steps):
        receiver.receive()
        expected = reference(0, step, odd_experts=True)
        engine_experts = {f"expert {e}": bool(same_bytes(engine.experts_up[e - engine.expert_start], expected[name]))
                          for e, name in enumerate(n for n in expected if ".moe." in n)
                          if 0 <= e - engine.expert_start < engine.experts_up.shape[0]}
        out["steps"].append({"loaded": engine.loaded_names, "experts_equal": engine_experts,
                             "fast_path_mismatches": mismatches(receiver.plugins.destination_map(engine).pieces,
                                                                expected)})
    receiver.close()
    return out


SUBSET = ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
          *(f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)))
"""What the subset steps of :func:`subset_ranks` move: q of the engine's fused qkv, the norm, all experts."""


def subset_ranks(rank: int, world: int, address: str, mode: str) -> dict | tuple:
    """A full step (version 100), two steps of :data:`SUBSET` (101, 102), a full step (103), then a step
    where the train ranks send :data:`SUBSET` and the gen ranks expect only its first two tensors, in
    update ``mode``. Gen ranks return, per landed step, the pieces that differ from what they should
    hold; every rank its bytes per step, how many subsets it derived, and the last step's error."""
    train = rank < TRAIN_RANKS
    local, size = (rank, TRAIN_RANKS) if train else (rank - TRAIN_RANKS, world - TRAIN_RANKS)
    options = RefitOptions(timeout_s=30, mode=mode)
    plan = [(100, None), (101, SUBSET), (102, SUBSET), (103, None)]
    if train:
        trainer = ToyTrainer(local, size)
        endpoint = RefitSender(trainer, rendezvous=address, rank=local, world_size=size, options=options)
    else:
        engine = ToyEngine(local, size)
        endpoint = RefitReceiver(engine, rendezvous=address, rank=local, world_size=size, options=options)
    endpoint.setup()
    out: dict = {"side": "train" if train else "gen", "bytes": [], "mismatches": []}
    held: dict = {}
    for step, (version, only) in enumerate(plan):
        fresh = reference(0, step)
        if train:
            trainer.load(fresh)
            stats = endpoint.send(version=version, only=only)
        else:
            stats = endpoint.receive(only=only)
            held.update({n: t for n, t in fresh.items() if only is None or n in only})
            out["mismatches"].append(mismatches(endpoint.plugins.destination_map(engine).pieces, held))
            out["version"] = endpoint.version
        out["bytes"].append(stats.bytes)
    out["derived"] = endpoint._subsets.derived
    started = time.monotonic()
    try:
        endpoint.send(version=104, only=SUBSET) if train else endpoint.receive(only=SUBSET[:2])
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        out["error"] = (type(exc).__name__, str(exc), time.monotonic() - started)
    if not train:
        out["after_error"] = mismatches(endpoint.plugins.destination_map(engine).pieces, held)
    endpoint.close()
    gone = weakref.ref(endpoint)
    gc.disable()  # a closed endpoint is freed at once, not at the next collection (it holds the model's memory)
    try:
        del endpoint
        out["freed_on_close"] = gone() is None
    finally:
        gc.enable()
    return out
