"""Rank programs of the FP8 refit tests: a Megatron-style trainer into a block-FP8 vLLM-style engine
(the benchmark's layouts, on CPU over gloo), train ranks first, then gen ranks."""

from __future__ import annotations

from typing import Any

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.contract.plugins import PluginManager
from refit_core.apps import same_bytes
from refit_core.kit.models import load_config
from refit_core.run.quant.reference import reference_quantize
from refit_core.tools.bench.layouts import MegatronStyleModel, VllmStyleModel, register


def fp8_refit_rank(rank: int, world: int, address: str, job: dict[str, Any]) -> dict[str, Any]:
    """One rank of a refit of ``job["model"]``; gen ranks check every byte against the reference
    quantizer after each step. Returns what the test asserts on, or ``{"error": ...}``."""
    import torch

    torch.set_num_threads(1)
    device = job.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    train = rank < job["train_tp"]
    config = dict(load_config(job["model"]), **job.get("config", {}))
    plugins = register(PluginManager(load_entry_points=False))
    options = RefitOptions(bucket_bytes=job.get("bucket_bytes", 1 << 20), timeout_s=60, **job.get("options", {}))
    try:
        if train:
            model = MegatronStyleModel(config, tp=job["train_tp"], rank=rank, device=device,
                                       fp8_block=job.get("source_block"))
            endpoint = RefitSender(model, rendezvous=address, rank=rank, world_size=job["train_tp"],
                                   options=options, plugins=plugins)
        else:
            local = rank - job["train_tp"]  # with job["replicas"], consecutive engines of gen_tp ranks each
            model = VllmStyleModel(config, tp=job["gen_tp"], rank=local % job["gen_tp"], device=device,
                                   fp8_block=job["block"])
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
    out["quantized_segments"] = sum(1 for s in segments if s.scales is not None)
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
            out["direct"], out["received"] = stats.direct_bytes, stats.bytes
    if not train:
        counts = endpoint.colocated_counts
        out["colocated_quantize_launches"] = endpoint.colocated_copies - (counts.launches if counts else 0)
    endpoint.close()
    return out


def _short(model: Any, piece: int) -> str:
    name = model.pieces[piece].spec.name
    return name.split(".", 3)[-1] if name.startswith("model.layers.") else name


def fp8_fault_rank(rank: int, world: int, address: str, job: dict[str, Any]) -> dict[str, Any]:
    """One rank of a two-step FP8 refit whose second step fails on gen rank 0, by ``job["fault"]``:
    ``"exchange"`` (its transport raises half-way through the step's rounds) or
    ``"quantize"`` (its receiver-side quantizer raises after its first tensor). Gen ranks report
    every tensor's state after the failure: ``old`` (step 0's values), ``new`` (step 1's) or ``mixed``."""
    import torch

    torch.set_num_threads(1)
    device = job.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    train = rank < job["train_tp"]
    config = dict(load_config(job["model"]), **job.get("config", {}))
    plugins = register(PluginManager(load_entry_points=False))
    options = RefitOptions(bucket_bytes=job.get("bucket_bytes", 64 << 10), timeout_s=30, **job.get("options", {}))
    local = rank if train else rank - job["train_tp"]
    if train:
        model: Any = MegatronStyleModel(config, tp=job["train_tp"], rank=rank, device="cpu")
        endpoint: Any = RefitSender(model, rendezvous=address, rank=rank, world_size=job["train_tp"],
                                    options=options, plugins=plugins)
    else:
        model = VllmStyleModel(config, tp=job["gen_tp"], rank=local, device="cpu", fp8_block=job["block"])
        endpoint = RefitReceiver(model, rendezvous=address, rank=local, world_size=world - job["train_tp"],
                                 options=options, plugins=plugins)
    schedule = endpoint.setup()
    out: dict[str, Any] = {"side": "train" if train else "gen"}
    if not train:
        out["receiver_quantized"] = sorted({model.pieces[q.piece].spec.name
                                            for q in schedule.receiver_quantizations_of(local)})
        out["scales_received"] = sorted({model.pieces[s.piece].spec.name
                                         for msgs in schedule.rounds_of_destination(local) for m in msgs
                                         for s in m.dst_segments if s.dtype == torch.float32
                                         and model.pieces[s.piece].spec.name.endswith("_scale_inv")})
    for step, seed in enumerate((10, 11)):
        if step == 1 and not train and local == 0:
            _inject(endpoint, job["fault"])
        try:
            if train:
                model.fill(seed)
                endpoint.send(version=step)
            else:
                endpoint.receive()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            failure = getattr(exc, "failure", None)
            out.update(error=type(exc).__name__, message=str(exc)[:2000],
                       torn=sorted(failure.torn) if failure is not None else None)
            break
    if not train:
        out["state"] = _states(model, 10, 11)
        out["version"] = endpoint.version
    endpoint.close()
    return out


def _inject(endpoint: Any, fault: str) -> None:
    if fault == "exchange":  # half-way: after the headers and half of the step's rounds
        at = 2 + len(endpoint._executor.plans) // 2
        transport = endpoint._executor.transport
        real, calls = transport.exchange, [0]

        def exchange(sends: Any, recvs: Any, after: Any = (), **options: Any) -> Any:
            calls[0] += 1
            if calls[0] == at:
                raise RuntimeError("injected: the transport failed mid-step")
            return real(sends, recvs, after, **options)

        transport.exchange = exchange
    elif fault == "quantize":
        quantizing = endpoint._quantizing
        inner, done = quantizing.quantizer, [0]

        class Failing:
            def quantize_into(self, *args: Any) -> None:
                if done[0] == 1:
                    raise RuntimeError("injected: the receiver-side quantizer failed")
                done[0] += 1
                inner.quantize_into(*args)

        quantizing.quantizer = Failing()
    else:
        raise ValueError(fault)


def _states(model: Any, old_seed: int, new_seed: int) -> dict[str, str]:
    """Every tensor this gen rank holds: "old", "new" or "mixed" (compared bit for bit)."""
    old, new = dict(model.expected(old_seed, reference_quantize)), dict(model.expected(new_seed, reference_quantize))
    out = {}
    for name, pieces in model.by_name().items():
        held = [p.view for p in pieces]
        if all(same_bytes(h, p.box.slice_of(old[name])) for h, p in zip(held, pieces)):
            out[name] = "old"
        elif all(same_bytes(h, p.box.slice_of(new[name])) for h, p in zip(held, pieces)):
            out[name] = "new"
        else:
            out[name] = "mixed"
    return out
