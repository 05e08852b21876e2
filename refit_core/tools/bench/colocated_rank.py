"""One process of the colocated benchmark (0: the trainer, 1: the engine): every model, every method timed.

Each step is timed from a common barrier to the engine's acknowledgement; between steps, with the trainer
idle, the engine samples the copy bound. The engine checks its weights bitwise after the last step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from refit_core.contract.options import Colocation, StridedCopy
from refit_core.kit.models import load_config
from refit_core.tools.bench import layouts
from refit_core.tools.bench.colocated_sync import PairSync
from refit_core.tools.bench.copybound import CopyBound, sync_device
from refit_core.tools.bench.fit import Fit, fit_layers, memory_budget
from refit_core.tools.bench.pingpong import PingPong

GiB = 1 << 30
TRAINERS = {"": layouts.MegatronStyleModel, "sequential": layouts.MegatronSequentialStyleModel}
"""Trainer layouts by model-entry suffix (``NAME:sequential``)."""


def model_entry(entry: str) -> tuple[str, str]:
    """``NAME[:VARIANT]`` -> (preset or config path, trainer variant)."""
    name, _, variant = entry.partition(":")
    if variant not in TRAINERS:
        raise SystemExit(f"unknown trainer layout {variant!r} in {entry!r}: use NAME or NAME:sequential")
    return name, variant


def needed_bytes(model_bytes: int, bound_bytes: int) -> int:
    """GPU memory a colocated run of a ``model_bytes`` model needs: the trainer's and the engine's copy
    (with 10% for refit's and the fill's working memory), the copy bound's two buffers and ping-pong's
    two 1 GiB buffers."""
    return int(2.2 * model_bytes) + 2 * min(model_bytes, bound_bytes) + 2 * GiB


def fit_model(name: str, config: dict[str, Any], budget_bytes: int | None, bound_bytes: int) -> Fit:
    """How ``name`` runs within ``budget_bytes`` (None: whole)."""
    return fit_layers(name, config, budget_bytes, lambda n: needed_bytes(n, bound_bytes))


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class _RefitSide:
    """This process's refit endpoint for method ``refit[:VARIANT][+check-first][+confirm]``, set up, with
    every step's :class:`~refit_core.StepStats` and (``--breakdown``) its trace."""

    def __init__(self, name: str, model: Any, sync: PairSync, job: dict, device: torch.device,
                 train: bool) -> None:
        from refit_core import RefitOptions, RefitReceiver, RefitSender

        variant, _, extras = name.partition(":")[2].partition("+")
        flags = set(extras.split("+"))
        options = RefitOptions(timeout_s=job["timeout_s"],
                               colocate=Colocation.AUTO if device.type == "cuda" else Colocation.SHARED,
                               strided_copies=StridedCopy(variant or RefitOptions().strided_copies),
                               overlap_check="check-first" not in flags, confirm="confirm" in flags,
                               step_trace=job.get("breakdown", False))
        cls = RefitSender if train else RefitReceiver
        self.endpoint: Any = cls(model, rendezvous=job["refit_address"], rank=0, world_size=1, options=options)
        self.endpoint.setup()
        self.links = sorted({link.value for link in self.endpoint.links.values()})
        self.sender = train
        self.sync = sync
        self.stats: list[Any] = []  # refit's StepStats (its own account of staged bytes)
        self.traces: list[dict[str, Any]] = []  # with --breakdown: each step's StepTrace, as a dict

    def step(self) -> None:
        if self.sender:
            self.stats.append(self.endpoint.send(version=self.sync.rounds))
        else:
            self.stats.append(self.endpoint.receive())
        trace = self.endpoint.colocated_trace
        if trace is not None:
            self.traces.append({"marks": dict(trace.marks), "gpu_ms": dict(trace.gpu_ms)})

    def copy_record(self) -> dict[str, Any]:
        """The engine's copy launches per step after batching (bound at the first step)."""
        counts = self.endpoint.colocated_counts
        return {"copies": self.endpoint.colocated_copies,
                "copy_counts": asdict(counts) if counts is not None else None}


def _timed(sync: PairSync, device: torch.device, step, before=None) -> tuple[float, int]:
    """One step from a common barrier: (seconds, peak bytes allocated during the step).

    ``before`` (the benchmark's own fill or poison, whose temporaries are no method's memory) runs
    first, outside both measurements."""
    if before is not None:
        before()
    sync_device(device)
    _reset_peak(device)
    sync.barrier()
    start = time.perf_counter()
    step()
    sync_device(device)
    return time.perf_counter() - start, _peak(device)


def _steps(step: Callable[[], Any], model: Any, sync: PairSync, job: dict, device: torch.device, train: bool,
           seed_base: int, bound: CopyBound | None) -> tuple[list[float], list[int]]:
    """Every step's seconds and peak allocation, the trainer filling the weights first and the engine
    poisoning them before the last; the copy bound sampled between timed steps, the trainer idle."""
    iters, warmup = job["iters"], job["warmup"]
    times, peaks = [], []
    for i in range(warmup + iters):
        seed = seed_base + i
        last = i == warmup + iters - 1
        before: Callable[[], Any] | None
        if train:
            before = lambda s=seed: model.fill(seed=s)  # noqa: E731
        else:
            before = model.poison if last else None
        seconds, peak = _timed(sync, device, step, before)
        times.append(seconds)
        peaks.append(peak)
        sync.barrier()  # the copy bound between steps, with the trainer idle (not filling)
        if bound is not None and i >= warmup:
            bound.sample()
        sync.barrier()
    return times, peaks


def _run_method(name: str, model: Any, sync: PairSync, job: dict, device: torch.device, train: bool,
                seed_base: int, bound: CopyBound | None) -> dict[str, Any]:
    """Method ``name`` on this process: its setup, steps, memory and (engine) check, as one record."""
    iters, warmup = job["iters"], job["warmup"]
    out: dict[str, Any] = {"method": name}
    base = _allocated(device)
    _reset_peak(device)
    start = time.perf_counter()
    runner: PingPong | _RefitSide
    if name == "ping-pong":
        runner = PingPong(model, sync, device, train)
        out["shared_bytes"] = runner.shared_bytes if train else 0
        out["fills"] = len(runner.buckets)
    else:
        runner = _RefitSide(name, model, sync, job, device, train)
        out["links"] = runner.links
    out["setup_s"] = time.perf_counter() - start
    setup_peak = _peak(device)  # buffers a method allocates once (ping-pong's pair, refit's own)
    times, peaks = _steps(runner.step, model, sync, job, device, train, seed_base, bound)
    out["seconds"] = times[warmup:]
    traces = runner.traces if isinstance(runner, _RefitSide) else []
    if traces:
        out["traces"] = traces[warmup:]
    out["peak_extra_bytes"] = max(0, max([setup_peak, *peaks]) - base)
    if isinstance(runner, _RefitSide) and runner.stats:
        out["staging_bytes"] = max(s.staging_bytes for s in runner.stats)
    if not train:
        bad = model.mismatches(seed=seed_base + warmup + iters - 1)
        out["checks"] = ["bitwise ok"] if not bad else [f"{len(bad)} pieces differ, e.g. {bad[:3]}"]
    if isinstance(runner, _RefitSide):
        if not train:
            out.update(runner.copy_record())
        runner.endpoint.close()
    del runner
    sync.barrier()
    return out


def _build(entry: str, fit: Fit, job: dict[str, Any], device: torch.device, train: bool) -> Any:
    """This process's model of ``entry`` as ``fit`` runs it: the trainer's layout, or the engine's."""
    path, variant = model_entry(entry)
    config = fit.config(load_config(path))
    if train:
        return TRAINERS[variant](config, tp=1, rank=0, device=device)
    block = job.get("fp8_block")
    model = layouts.VllmStyleModel(config, tp=1, rank=0, device=device,
                                   fp8_block=(block, block) if block else None)
    if block and device.type == "cuda":
        torch.cuda.empty_cache()  # the high-precision tensors the FP8 ones replaced: give them to the trainer
    return model


def run_process(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    """Process ``rank`` of a colocated run: per model, every method's record (the engine's row also holds
    the copy bound's samples), or why the model was skipped."""
    train = rank == 0
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layouts.register()
    sync = PairSync(job["sync_address"], rank, job["timeout_s"])
    results = []
    for number, name in enumerate(job["models"]):
        path, _ = model_entry(name)
        fit = fit_model(name, load_config(path), memory_budget(device, job.get("memory_gib")), job["bound_bytes"])
        if fit.skipped:
            results.append({"model": name, "skipped": fit.reason, "methods": []})
            continue
        model = _build(name, fit, job, device, train)
        results.append(_run_model(number, fit, model, sync, job, device, train))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"side": "train" if train else "gen", "models": results}


def _run_model(number: int, fit: Fit, model: Any, sync: PairSync, job: dict[str, Any], device: torch.device,
               train: bool) -> dict[str, Any]:
    """Every method on model ``number``, the copy bound first in the engine's row."""
    row: dict[str, Any] = {"model": fit.label, "bytes": model.nbytes, "methods": [],
                           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    bound = CopyBound(model.nbytes, device, job["bound_bytes"]) if not train else None
    for m, method in enumerate(job["methods"]):
        if method == "copy-bound":
            continue
        job_m = dict(job, refit_address=job["refit_addresses"][number * len(job["methods"]) + m])
        row["methods"].append(_run_method(method, model, sync, job_m, device, train, 100 * m, bound))
    sync.barrier()
    if bound is not None:
        bound.top_up()
        row["methods"].insert(0, {"method": "copy-bound", "seconds": bound.samples, "chunk_bytes": bound.chunk,
                                  "checks": ["-"], "peak_extra_bytes": 0})
        bound.close()
    sync.barrier()
    return row


__all__ = ["TRAINERS", "fit_model", "model_entry", "needed_bytes", "run_process"]
