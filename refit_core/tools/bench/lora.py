"""``refit bench --lora``: a LoRA-trained model refitted three ways, side by side on one train and one gen rank.

- **full**: every weight of the model (what a LoRA user without refit's LoRA support moves);
- **adapter**: only the adapters' ``lora_A`` / ``lora_B`` (adapter mode);
- **merged**: every weight, the adapted ones merged in the pack step (``W + scale * B @ A``, merged mode);
- **wire**: the adapter method's bytes as one p2p of one contiguous buffer over the same pair, the bound of
  an adapter step (checked by checksum).

The model is a HF config's checkpoint (a preset, e.g. ``llama-3-8b-shape``), every tensor whole on the one
train rank and the one gen rank (``cuda:0`` -> ``cuda:1`` over NCCL, or CPU over gloo), random values;
the adapter has rank ``r`` on every targeted linear weight. The gen rank checks every received byte of
the full and adapter methods, and a sample of merged boxes, against values it computes itself.
Separately, :func:`refit_core.run.merge.time_merge` times the merge of each distinct weight shape on the
CPU: the pack step's extra work in merged mode, on its own.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.hookspecs import hookimpl
from refit_core.contract.lora import (
    LORA_A,
    AdapterTensorName,
    LoraFactors,
    LoraMerge,
    LoraSpec,
    MergedSourcePiece,
    adapter_tensor_names,
)
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.spec import TensorSpec
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import checkpoint_specs, load_config
from refit_core.kit.verify import same_bytes
from refit_core.plan.lora import adapted_module
from refit_core.run.merge import lora_delta, merged_box, time_merge
from refit_core.tools.bench.comms import open_bench_comm
from refit_core.tools.bench.method import current_stream
from refit_core.tools.bench.wire import checksum, payload, verify_checksums
from refit_core.units import format_bytes

METHODS = ("full", "adapter", "merged", "wire")
WIRE = "wire"
PLUGIN_NAME = "refit-bench-lora"


@dataclass
class Holder:
    """A side's pieces for one method (``source``: the train side's)."""

    pieces: list[Any]
    source: bool


@hookimpl
def refit_register_backends(register: Any) -> None:
    register(Backend("bench-lora", frozenset({TRAIN, GEN}), "refit bench --lora: whole tensors on one rank"))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    return list(model.pieces) if isinstance(model, Holder) and model.source else None


@hookimpl
def refit_destination_map(model: Any) -> DestinationMap | None:
    return DestinationMap(list(model.pieces)) if isinstance(model, Holder) and not model.source else None


@hookimpl
def refit_begin_update(model: Any) -> bool | None:
    return False if isinstance(model, Holder) else None


@hookimpl
def refit_finish_update(model: Any, version: int) -> bool | None:
    return True if isinstance(model, Holder) else None


def register(pm: PluginManager | None = None) -> PluginManager:
    import sys

    pm = pm or get_plugin_manager()
    if not pm.has_plugin(PLUGIN_NAME):
        pm.register(sys.modules[__name__], name=PLUGIN_NAME)
    return pm


class StaticAdapters:
    """One rank's whole adapters (nothing to gather)."""

    def __init__(self, factors: dict[str, LoraFactors]) -> None:
        self.factors = factors

    def gather(self) -> dict[str, LoraFactors]:
        return self.factors


def _draw(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02).to(dtype)


def _seed(name: str, version: int) -> int:
    import zlib

    return zlib.crc32(f"{name}@{version}".encode())


def model_tensors(config: dict[str, Any], lora: LoraSpec) -> tuple[list[TensorSpec], dict[str, tuple[TensorSpec,
                                                                                                     TensorSpec]]]:
    """The checkpoint's specs, and ``{module: (A spec, B spec)}`` of every adapted weight."""
    specs = checkpoint_specs(config)
    adapters = {}
    for spec in specs:
        module = adapted_module(spec.name, lora)
        if module is None or len(spec.shape) != 2:
            continue
        out_features, in_features = spec.shape
        a, b = adapter_tensor_names(module)
        adapters[module] = (TensorSpec(a, (lora.rank, in_features), spec.dtype),
                            TensorSpec(b, (out_features, lora.rank), spec.dtype))
    return specs, adapters


def _worker(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 trains, rank 1 serves; every method in turn, each its own refit."""
    register()
    train = rank == 0
    device = torch.device(job["devices"][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    lora = LoraSpec.parse(job["lora"])
    specs, adapters = model_tensors(job["config"], lora)
    weights = {s.name: _draw(s.shape, s.dtype, device, _seed(s.name, 0)) for s in specs}
    factors = {module: LoraFactors(_draw(a.shape, a.dtype, device, _seed(a.name, 1)),
                                   _draw(b.shape, b.dtype, device, _seed(b.name, 1)))
               for module, (a, b) in adapters.items()}
    if not train:  # the engine's copies start elsewhere
        weights = {n: torch.zeros_like(t) for n, t in weights.items()}
    out: dict[str, Any] = {}
    for method in job["methods"]:
        if method == WIRE:
            continue
        options = RefitOptions(timeout_s=job["timeout_s"], bucket_bytes=job["bucket_bytes"])
        address = f"127.0.0.1:{job['ports'][method]}"
        holder = _pieces(method, specs, adapters, weights, factors, lora, train, device)
        if train:
            endpoint: Any = RefitSender(holder, rendezvous=address, rank=0, world_size=1, options=options,
                                        host_id="bench-train")
        else:
            endpoint = RefitReceiver(holder, rendezvous=address, rank=0, world_size=1, options=options,
                                     host_id="bench-gen")
        endpoint.setup()
        times, nbytes = [], 0
        for step in range(job["warmup"] + job["iters"]):
            start = time.perf_counter()
            stats = endpoint.send(version=step + 1) if train else endpoint.receive()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= job["warmup"]:
                times.append(time.perf_counter() - start)
            nbytes = stats.bytes
        row: dict[str, Any] = {"bytes": nbytes, "seconds": statistics.median(times)}
        if not train:
            row["check"] = _check(method, holder, weights_of(specs, device), factors, adapters, lora)
        endpoint.close()
        out[method] = row
    if WIRE in job["methods"]:
        out[WIRE] = _wire(out["adapter"]["bytes"], device, job, train)
    return out


def _wire(nbytes: int, device: torch.device, job: dict[str, Any], train: bool) -> dict[str, Any]:
    """The adapter step's bytes as one p2p of one contiguous buffer, timed like the refits."""
    store = dist.TCPStore("127.0.0.1", job["ports"][WIRE], 2, train, timedelta(seconds=job["timeout_s"]))
    comm = open_bench_comm(store, "lora-wire", 2, 0 if train else 1, device)
    buffer, _ = payload(device, train, [nbytes])
    stream = current_stream(device)
    times = []
    for step in range(job["warmup"] + job["iters"]):
        start = time.perf_counter()
        if train:
            comm.post([(1, buffer)], [], stream)
        else:
            comm.post([], [(0, buffer)], stream)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= job["warmup"]:
            times.append(time.perf_counter() - start)
    check = verify_checksums(store, train, [(buffer, "lora-wire/checksum")], checksum)
    comm.close()
    return {"bytes": nbytes, "seconds": statistics.median(times), "check": check or "-"}


def weights_of(specs: list[TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """The train side's weights, drawn again on the gen rank."""
    return {s.name: _draw(s.shape, s.dtype, device, _seed(s.name, 0)) for s in specs}


def _pieces(method: str, specs: list[TensorSpec], adapters: dict[str, tuple[TensorSpec, TensorSpec]],
            weights: dict[str, torch.Tensor], factors: dict[str, LoraFactors], lora: LoraSpec, train: bool,
            device: torch.device) -> Holder:
    kind = SourcePiece if train else DestinationPiece
    if method == "adapter":
        pieces = []
        for module, (a, b) in adapters.items():
            values = (factors[module].a, factors[module].b) if train else \
                (torch.zeros(a.shape, dtype=a.dtype, device=device), torch.zeros(b.shape, dtype=b.dtype, device=device))
            pieces += [kind(spec, spec.full_box(), value) for spec, value in zip((a, b), values)]
        return Holder(pieces, train)
    if method == "merged" and train:
        provider = StaticAdapters(factors)
        merged: list[Any] = []
        for spec in specs:
            adapted = adapted_module(spec.name, lora)
            if adapted is not None and adapted in factors:
                merge = LoraMerge(adapted, lora.scale, provider)
                merged.append(MergedSourcePiece(spec, spec.full_box(), weights[spec.name], merge=merge))
            else:
                merged.append(SourcePiece(spec, spec.full_box(), weights[spec.name]))
        return Holder(merged, True)
    return Holder([kind(spec, spec.full_box(), weights[spec.name]) for spec in specs], train)


def _check(method: str, holder: Holder, expected: dict[str, torch.Tensor], factors: dict[str, LoraFactors],
           adapters: dict[str, tuple[TensorSpec, TensorSpec]], lora: LoraSpec) -> str:
    """``bitwise ok`` or what differs: every received tensor (merged: every weight; adapted ones merged
    here with the same arithmetic)."""
    bad = []
    for piece in holder.pieces:
        name = piece.spec.name
        adapter = AdapterTensorName.read(name)
        if adapter is not None:
            pair = factors[adapter.module]
            want = pair.a if adapter.half == LORA_A else pair.b
        else:
            want = expected[name]
            module = adapted_module(name, lora)
            if method == "merged" and module in adapters:
                want = merged_box(want, lora_delta(factors[module].a, factors[module].b, lora.scale))
        if not same_bytes(piece.view, want):
            bad.append(name)
    return "bitwise ok" if not bad else f"{len(bad)} tensor(s) differ: {bad[:3]}"


@dataclass(frozen=True)
class LoraBench:
    """What :func:`run` measured: per method, bytes per step, median step seconds and the check."""

    model: str
    lora: LoraSpec
    device: str
    rows: dict[str, dict[str, Any]]
    merge_cpu_s: float
    """The CPU time of merging every adapted weight of the model once (sum over shapes of
    :func:`time_merge`), what merged mode adds to a CPU sender's pack steps."""
    merge_lines: list[str]
    merge_gpu_s: float | None = None
    """The same on the train GPU (None: a CPU run)."""

    def table(self) -> str:
        full = self.rows.get("full", {}).get("bytes", 0)
        lines = [f"refit bench --lora: {self.model}, r={self.lora.rank}, targets {','.join(self.lora.targets)}, "
                 f"{self.device}", "| method | bytes/step | share of full | step time | GB/s | check |",
                 "|---|---|---|---|---|---|"]
        for method, row in self.rows.items():
            share = f"{row['bytes'] / full:.2%}" if full else "-"
            gbps = row["bytes"] / row["seconds"] / 1e9 if row["seconds"] else 0.0
            lines.append(f"| {method} | {format_bytes(row['bytes'])} | {share} | {row['seconds'] * 1e3:.1f} ms "
                         f"| {gbps:.2f} | {row.get('check', '-')} |")
        if WIRE in self.rows and "adapter" in self.rows:
            wire_s, adapter_s = self.rows[WIRE]["seconds"], self.rows["adapter"]["seconds"]
            lines.append(f"adapter mode: {wire_s / adapter_s:.3f} of the wire on its own bytes (wire "
                         f"{wire_s * 1e3:.2f} ms, adapter {adapter_s * 1e3:.2f} ms)")
        if not self.merge_lines:
            return "\n".join(lines)
        lines += [f"merge on the CPU (the pack step's extra work in merged mode), per shape: {line}"
                  for line in self.merge_lines]
        lines.append(f"merge on the CPU, the whole model once: {self.merge_cpu_s:.3f} s")
        if self.merge_gpu_s is not None:
            lines.append(f"merge on the GPU, the whole model once: {self.merge_gpu_s * 1e3:.1f} ms")
        return "\n".join(lines)


def merge_cpu_time(config: dict[str, Any], lora: LoraSpec, repeats: int = 3,
                   device: str = "cpu") -> tuple[float, list[str]]:
    """The time of merging every adapted weight once on ``device`` (default the CPU): each distinct
    shape timed, times its count."""
    _, adapters = model_tensors(config, lora)
    shapes: dict[tuple[int, int, torch.dtype], int] = {}
    for a, b in adapters.values():
        key = (b.shape[0], a.shape[1], a.dtype)
        shapes[key] = shapes.get(key, 0) + 1
    total, lines = 0.0, []
    for (out_features, in_features, dtype), count in sorted(shapes.items(), key=lambda kv: kv[0][:2]):
        timing = time_merge(out_features, in_features, lora.rank, dtype=dtype, repeats=repeats, device=device)
        total += timing.seconds * count
        lines.append(f"{timing.line()} x {count}")
    return total, lines


def run(model: str, lora: LoraSpec, *, device: str = "cpu", warmup: int = 1, iters: int = 3,
        bucket_bytes: int | None = None, timeout_s: float = 300.0, methods: tuple[str, ...] = METHODS,
        merge_repeats: int = 3) -> LoraBench:
    """Run ``methods`` on one train and one gen rank (``cuda``: GPUs 0 and 1, or 0 and 0); the CPU merge
    timings only with ``merged``."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or (WIRE in methods and "adapter" not in methods):
        raise ValueError(f"refit bench --lora methods {list(methods)}: choose from {list(METHODS)} "
                         "(wire moves the adapter method's bytes: it needs adapter)")
    config = load_config(model)
    if device == "cuda":
        last = max(0, torch.cuda.device_count() - 1)
        devices = ["cuda:0", f"cuda:{min(1, last)}"]
    else:
        devices = ["cpu", "cpu"]
    job = {"config": config, "lora": _spec_text(lora), "devices": devices, "methods": list(methods),
           "ports": {m: free_port() for m in methods}, "warmup": warmup, "iters": iters,
           "bucket_bytes": bucket_bytes, "timeout_s": timeout_s}
    results = spawn(_worker, 2, job, timeout_s=timeout_s * (len(methods) + 1))
    rows = {m: {"bytes": results[0][m]["bytes"], "seconds": max(results[0][m]["seconds"], results[1][m]["seconds"]),
                "check": results[1][m]["check"]} for m in methods}
    if "merged" not in methods:
        return LoraBench(model, lora, device, rows, 0.0, [], None)
    merge_s, lines = merge_cpu_time(config, lora, merge_repeats)
    gpu_s = merge_cpu_time(config, lora, merge_repeats, device="cuda:0")[0] if device == "cuda" else None
    return LoraBench(model, lora, device, rows, merge_s, lines, gpu_s)


def _spec_text(lora: LoraSpec) -> str:
    return f"r={lora.rank},alpha={lora.alpha},targets={','.join(lora.targets)}"


__all__ = ["LoraBench", "merge_cpu_time", "run"]
