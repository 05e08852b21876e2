"""Rank programs for the colocated tests: train ranks first, then gen ranks, each its own process.

``hosts`` gives every rank a ``host_id`` (train ranks' first): ranks with equal ids share memory, so
one refit mixes shared-memory pairs and gloo pairs on this one machine.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.plan.links import Link

FAULTS = ("free", "realloc")


class FinishTogether:
    """Keeps train rank 0 (the refit store's host) alive until every rank has its outcome, so a rank
    that fails early cannot take the store away before its peers have read its error."""

    def __init__(self, address: str, rank: int, world: int) -> None:
        host, port = address.rsplit(":", 1)
        self.rank, self.world = rank, world
        self.store = dist.TCPStore(host, int(port), is_master=rank == 0, timeout=timedelta(seconds=120),
                                   wait_for_workers=False)

    def __call__(self, outcome):
        self.store.add("finished", 1)
        deadline = time.monotonic() + 120
        while self.rank == 0 and self.store.add("finished", 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.05)
        return outcome


def _bench_models(model: str, train: bool, rank: int, tp: int):
    from refit_core.kit.models import load_config
    from refit_core.tools.bench import layouts

    layouts.register()
    cls = layouts.MegatronStyleModel if train else layouts.VllmStyleModel
    return cls(load_config(model), tp=tp, rank=rank, device="cpu")


def _fault(model, kind: str) -> str:
    """Make the trainer break the colocation contract on a parameter; returns the parameter's HF name."""
    name = next(n for n in model.params if "linear_proj" in n)
    hf = next(p.spec.name for p in model.pieces if p.view.untyped_storage().data_ptr()
              == model.params[name].untyped_storage().data_ptr())
    if kind == "free":  # what FSDP does to an unsharded parameter after use
        model.params[name].untyped_storage().resize_(0)
    else:  # a new tensor for the parameter (``param.data = ...``), pieces enumerated afresh
        model.params[name] = torch.randn_like(model.params[name])
        model.pieces = []
        model._pieces()
    return hf


def bench_ranks(rank: int, world: int, addresses: tuple[str, str], model: str, train_size: int,
                hosts: list[str], steps: int, options: dict, fault: str | None = None, fault_rank: int = 0):
    """One rank of a Megatron-style -> vLLM-style refit (TP ``train_size`` -> TP ``world - train_size``).

    Returns per-step checks, or ``("error", type, message)``.
    """
    finish = FinishTogether(addresses[1], rank, world)
    return finish(_bench_rank(rank, world, addresses[0], model, train_size, hosts, steps, options, fault,
                              fault_rank))


def _bench_rank(rank: int, world: int, address: str, model: str, train_size: int, hosts: list[str],
                steps: int, options: dict, fault: str | None, fault_rank: int):
    train = rank < train_size
    local, size = (rank, train_size) if train else (rank - train_size, world - train_size)
    net = _bench_models(model, train, local, size)
    cls = RefitSender if train else RefitReceiver
    endpoint = cls(net, rendezvous=address, rank=local, world_size=size, host_id=hosts[rank],
                   options=RefitOptions(**options))
    try:
        endpoint.setup()
        links = sorted({link.value for pair, link in endpoint.links.items()
                        if pair[0 if train else 1] == local})
        results = []
        for step in range(steps):
            if train:
                net.fill(seed=step)
                if fault is not None and step == 1 and local == fault_rank:
                    results.append({"faulted": _fault(net, fault)})
                stats = endpoint.send(version=100 + step)
                results.append({"version": stats.version, "bytes": stats.bytes, "staging": stats.staging_bytes})
            else:
                net.poison()
                stats = endpoint.receive()
                results.append({"version": stats.version, "bytes": stats.bytes, "staging": stats.staging_bytes,
                                "mismatches": net.mismatches(seed=step), "engine_version": net.version})
        shared_storage = (any(p.view.untyped_storage().is_shared() for p in net.pieces)
                          if train and Link.SHARED_MEMORY.value in links else None)
        counts = endpoint.colocated_counts if not train else None
        endpoint.close()
        return {"side": "train" if train else "gen", "links": links, "steps": results,
                "shared_storage": shared_storage, "copy_counts": counts}
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return ("error", type(exc).__name__, str(exc))


def toy_ranks(rank: int, world: int, addresses: tuple[str, str], train_size: int, hosts: list[str], steps: int,
              options: dict):
    """One rank of the toy refit (per-expert names, replicas, bf16 casts) with mixed links."""
    finish = FinishTogether(addresses[1], rank, world)
    return finish(_toy_rank(rank, world, addresses[0], train_size, hosts, steps, options))


def _toy_rank(rank: int, world: int, address: str, train_size: int, hosts: list[str], steps: int, options: dict):
    from refit_toy.demo import reference
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core.kit.verify import mismatches

    train = rank < train_size
    local, size = (rank, train_size) if train else (rank - train_size, world - train_size)
    model = ToyTrainer(local, size) if train else ToyEngine(local, size)
    cls = RefitSender if train else RefitReceiver
    endpoint = cls(model, rendezvous=address, rank=local, world_size=size, host_id=hosts[rank],
                   options=RefitOptions(**options))
    try:
        endpoint.setup()
        links = sorted({link.value for pair, link in endpoint.links.items() if pair[0 if train else 1] == local})
        results = []
        for step in range(steps):
            if train:
                model.load(reference(0, step))
                results.append({"version": endpoint.send(version=step).version})
            else:
                stats = endpoint.receive()
                pieces = endpoint.plugins.destination_map(model).pieces
                results.append({"version": stats.version, "mismatches": mismatches(pieces, reference(0, step))})
        endpoint.close()
        return {"side": "train" if train else "gen", "links": links, "steps": results}
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return ("error", type(exc).__name__, str(exc))
