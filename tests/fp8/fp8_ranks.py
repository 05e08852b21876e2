"""Rank programs of the FP8 refit tests: a Megatron-style trainer into a block-FP8 vLLM-style engine
(the benchmark's layouts, on CPU over gloo), train ranks first, then gen ranks."""

from __future__ import annotations

from typing import Any

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.bench.layouts import MegatronStyleModel, VllmStyleModel, register
from refit_core.models import load_config
from refit_core.plugins import PluginManager
from refit_core.quant.reference import reference_quantize


def fp8_refit_rank(rank: int, world: int, address: str, job: dict[str, Any]) -> dict[str, Any]:
    """One rank of a refit of ``job["model"]``; gen ranks check every byte against the reference
    quantizer after each step. Returns what the test asserts on, or ``{"error": ...}``."""
    import torch

    torch.set_num_threads(1)
    train = rank < job["train_tp"]
    config = dict(load_config(job["model"]), **job.get("config", {}))
    plugins = register(PluginManager(load_entry_points=False))
    options = RefitOptions(bucket_bytes=job.get("bucket_bytes", 1 << 20), timeout_s=60, **job.get("options", {}))
    try:
        if train:
            model = MegatronStyleModel(config, tp=job["train_tp"], rank=rank, device="cpu",
                                       fp8_block=job.get("source_block"))
            endpoint = RefitSender(model, rendezvous=address, rank=rank, world_size=job["train_tp"],
                                   options=options, plugins=plugins)
        else:
            local = rank - job["train_tp"]
            model = VllmStyleModel(config, tp=job["gen_tp"], rank=local, device="cpu", fp8_block=job["block"])
            model.poison()
            endpoint = RefitReceiver(model, rendezvous=address, rank=local, world_size=world - job["train_tp"],
                                     options=options, plugins=plugins)
        schedule = endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects setup errors
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"side": "train" if train else "gen", "bytes": schedule.summary.bytes, "mismatches": []}
    my_rounds = schedule.rounds_of_source(rank) if train else schedule.rounds_of_destination(rank - job["train_tp"])
    segments = [s for msgs in my_rounds for m in msgs for s in (m.src_segments if train else m.dst_segments)]
    quantized = {_short(model, s.piece) for s in segments if s.scales is not None}
    out["sender_quantized"] = sorted(quantized) if train else []
    if not train:
        local = rank - job["train_tp"]
        out["receiver_quantized"] = sorted({_short(model, q.piece) for q in schedule.receiver_quantizations_of(local)})
    for step in range(job.get("steps", 2)):
        seed = 10 + step
        if train:
            model.fill(seed)
            endpoint.send(version=step)
        else:
            model.poison()
            stats = endpoint.receive()
            out["mismatches"] += [f"step {step}: {m}" for m in model.mismatches(seed, reference_quantize)]
            out["version"] = stats.version
    endpoint.close()
    return out


def _short(model: Any, piece: int) -> str:
    name = model.pieces[piece].spec.name
    return name.split(".", 3)[-1] if name.startswith("model.layers.") else name
