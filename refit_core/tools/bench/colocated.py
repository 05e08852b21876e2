"""The colocated benchmark: a trainer and an engine process on one GPU (or one host), side by side.

``python -m refit_core.tools.bench.colocated --models llama-3-8b-shape,qwen3-30b-a3b-shape --out PREFIX``

A model entry ``NAME:sequential`` gives the trainer one parameter per expert (Megatron's
``SequentialMLP``: thousands of small source tensors into the engine's stacked ``w13`` / ``w2``).

Process 0 holds a Megatron-style model, process 1 a vLLM-style model (:mod:`refit_core.tools.bench.layouts`),
on the same device. In one run, each model shape, each timed on the trainer from a common barrier to
the engine's acknowledgement (median of ``--iters`` steps, after ``--warmup``):

- ``copy-bound``: one on-device copy of the same number of bytes (in the engine process, through two
  buffers of ``min(model, --bound-gib)``: a copy of every byte, chunk after chunk, timed as one), warm
  (``BOUND_WARMUP`` copies first), the median of at least ``MIN_BOUND_SAMPLES`` copies taken between
  the other methods' steps (interleaved, with the trainer idle): no refit can beat one read and one
  write of every byte. Every ``of copy bound`` goes through
  :func:`~refit_core.tools.bench.validity.check_ratio`: above 1.02, or a bound under half the GPU's
  nominal copy rate (timed cold), prints ``INVALID (reason)``.
- ``ping-pong``: the pattern of today's colocated RL stacks (NeMo-RL ``stream_weights_via_ipc_zmq``,
  verl, slime): the trainer gathers HF tensors into two 1 GiB buffers shared once through IPC (or
  larger, if one tensor needs it), alternately, synchronizes and signals; the engine unpacks each
  into its layout (what ``load_weights`` does), synchronizes and acknowledges. Metadata is computed
  once at setup (generous to the baseline).
- ``refit``: :class:`~refit_core.RefitSender` / :class:`~refit_core.RefitReceiver`, whose same-device
  pair copies straight out of the trainer's memory (CUDA IPC; shared memory on CPU).
  ``refit:VARIANT`` runs it with ``RefitOptions(strided_copies=VARIANT)`` (a
  :class:`~refit_core.contract.options.StridedCopy`: how the engine moves its large strided copies);
  ``refit:VARIANT+check-first`` also with ``overlap_check=False`` (the trainer checks its memory
  before it signals *ready*, instead of while the engine copies); ``+confirm`` with ``confirm=True``
  (the landing vote: what the commit point costs). Plain ``refit`` runs with
  :class:`~refit_core.RefitOptions`' defaults.

``--breakdown`` traces every timed refit step (``RefitOptions(step_trace=True)``) and prints, per
refit method, the median of each phase of :func:`refit_core.run.timing.breakdown`: the trainer's
check, the ready signal, the engine's queueing, the device time of each launch group, and the tail.
``--variants`` (for deciding the default :class:`~refit_core.contract.options.StridedCopy`) runs the copy bound
and every ``refit:VARIANT`` plus ``refit:foreach+check-first``, ``refit:triton+check-first`` and
``refit:+confirm`` side by side in one run (each bitwise checked), with ``--breakdown``.

``--fp8-block N`` gives the engine block-FP8 linear weights (``N x N`` blocks, scales beside them, as
vLLM's FP8 checkpoints): refit quantizes straight from the trainer's memory in batched launches, and
the copy bound is then one copy of the engine's (FP8) bytes. Ping-pong does not quantize: not run.

A shape that does not fit the GPU's memory (both processes hold the model: ``needed_bytes``) runs as
a slice of its layers, same per-layer shapes, named ``NAME[K/N layers]``, or is skipped with a
one-line reason (:mod:`refit_core.tools.bench.fit`); ``--memory-gib`` sets the budget (default: the
GPU's memory; none on CPU).

Every method's last step is checked bitwise on the engine (weights poisoned with NaN before it).
Extra memory is each process's peak allocation above its model during the method's setup and steps
(CUDA; the benchmark's own weight fill, whose temporaries are the size of the largest tensor in fp32,
is excluded), which for the trainer includes what it shares with the engine; on CPU the table shows
the bytes refit reports staged. Writes ``PREFIX.json`` and ``PREFIX.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.options import Colocation, StridedCopy
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import load_config
from refit_core.net.transport.memory import SharedStorage, export_storage, open_storage
from refit_core.run.timing import StepTrace, breakdown
from refit_core.tools.bench import layouts
from refit_core.tools.bench.copybound import MIN_BOUND_SAMPLES, CopyBound, sync_device
from refit_core.tools.bench.fit import Fit, fit_layers
from refit_core.tools.bench.validity import Ratio, bound_rate_problem, check_ratio
from refit_core.tools.bench.methods import hf_tensors, scatter

GiB = 1 << 30
METHODS = ("copy-bound", "ping-pong", "refit")
CONFIRM = "refit:+confirm"
"""``refit`` with the landing vote (``confirm=True``): what the commit point costs (on request)."""
VARIANTS = (*(f"refit:{v.value}" for v in StridedCopy),
            *(f"refit:{v.value}+check-first" for v in (StridedCopy.FOREACH, StridedCopy.TRITON)))
"""``refit`` with each way of moving strided copies, and with the trainer's check before its *ready*
signal instead of overlapping the engine's copies (``--variants``)."""
TRAINERS = {"": layouts.MegatronStyleModel, "sequential": layouts.MegatronSequentialStyleModel}
"""Trainer layouts by model-entry suffix (``NAME:sequential``)."""


def _model_entry(entry: str) -> tuple[str, str]:
    """``NAME[:VARIANT]`` -> (preset or config path, trainer variant)."""
    name, _, variant = entry.partition(":")
    if variant not in TRAINERS:
        raise SystemExit(f"unknown trainer layout {variant!r} in {entry!r}: use NAME or NAME:sequential")
    return name, variant


class _Sync:
    """Barriers and small signals between the two processes, through a TCPStore."""

    def __init__(self, address: str, rank: int, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.rank = rank
        self.rounds = 0

    def barrier(self) -> None:
        key = f"barrier/{self.rounds}"
        self.rounds += 1
        self.store.add(key, 1)
        while self.store.add(key, 0) < 2:
            time.sleep(0.0002)
        self.store.add(key, 1)  # seen: the store's host (rank 0) must not exit before its peer got here
        while self.rank == 0 and self.store.add(key, 0) < 4:
            time.sleep(0.0002)

    def signal(self, key: str, value: bytes = b"1") -> None:
        self.store.set(key, value)  # type: ignore[arg-type]  # torch's stub says str; bytes are stored as is

    def take(self, key: str) -> bytes:
        self.store.wait([key])
        value = self.store.get(key)
        self.store.delete_key(key)
        return value


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


MEMORY_RESERVE = 3 * GiB
"""GPU memory kept out of the budget: two processes' CUDA contexts and the allocator's slack."""


def needed_bytes(model_bytes: int, bound_bytes: int) -> int:
    """GPU memory a colocated run of a ``model_bytes`` model needs: the trainer's and the engine's copy
    (with 10% for refit's and the fill's working memory), the copy bound's two buffers and ping-pong's
    two 1 GiB buffers."""
    return int(2.2 * model_bytes) + 2 * min(model_bytes, bound_bytes) + 2 * GiB


def fit_model(name: str, config: dict[str, Any], budget_bytes: int | None, bound_bytes: int) -> Fit:
    """How ``name`` runs within ``budget_bytes`` (None: whole)."""
    return fit_layers(name, config, budget_bytes, lambda n: needed_bytes(n, bound_bytes))


def memory_budget(device: torch.device, memory_gib: float | None) -> int | None:
    """The bytes a run may use: ``memory_gib`` if given, else the GPU's memory less the reserve (None on CPU)."""
    if memory_gib is not None:
        return int(memory_gib * GiB)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory - MEMORY_RESERVE


# -- the ping-pong baseline -----------------------------------------------------------------------

def _buckets(tensors: list, buffer_bytes: int) -> list[list[tuple[int, int]]]:
    """HF tensors (by index) packed in order into buffers: ``[(tensor index, byte offset)]`` per fill."""
    buckets: list[list[tuple[int, int]]] = [[]]
    used = 0
    for i, (spec, _) in enumerate(tensors):
        size = (spec.nbytes + 255) // 256 * 256
        if buckets[-1] and used + size > buffer_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((i, used))
        used += size
    return buckets


class PingPong:
    """Two shared buffers; the trainer packs HF tensors, the engine unpacks them (both Python-driven)."""

    def __init__(self, model: Any, sync: _Sync, device: torch.device, train: bool, buffer_bytes: int = GiB) -> None:
        self.tensors = hf_tensors(model)
        largest = max(spec.nbytes for spec, _ in self.tensors)
        self.buffer_bytes = max(buffer_bytes, (largest + 255) // 256 * 256)
        self.buckets = _buckets(self.tensors, self.buffer_bytes)
        self.sync, self.device, self.train = sync, device, train
        self.step_index = 0
        if train:
            self.buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            shared = [export_storage(b.untyped_storage()) for b in self.buffers]
            sync.signal("pingpong/buffers", json.dumps([s.__dict__ for s in shared]).encode())
        else:
            shared = [SharedStorage(**s) for s in json.loads(sync.take("pingpong/buffers").decode())]
            self._opened = [open_storage(s, device) for s in shared]
            self.buffers = [torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (self.buffer_bytes,), (1,))
                            for st in self._opened]

    @property
    def shared_bytes(self) -> int:
        return 2 * self.buffer_bytes

    def _view(self, buffer: torch.Tensor, index: int, offset: int) -> torch.Tensor:
        spec = self.tensors[index][0]
        return buffer[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)

    def step(self) -> None:
        step, self.step_index = self.step_index, self.step_index + 1
        for k, bucket in enumerate(self.buckets):
            buffer = self.buffers[k % 2]
            key = f"pingpong/{step}/{k}"
            if self.train:
                if k >= 2:
                    self.sync.take(f"{key}/ack-{k - 2}")
                for index, offset in bucket:
                    spec, parts = self.tensors[index]
                    out = self._view(buffer, index, offset)
                    for box, view in parts:
                        box.slice_of(out).copy_(view)
                sync_device(self.device)
                self.sync.signal(key)
            else:
                self.sync.take(key)
                for index, offset in bucket:
                    scatter(self._view(buffer, index, offset), self.tensors[index][1])
                sync_device(self.device)
                if k + 2 < len(self.buckets):
                    self.sync.signal(f"pingpong/{step}/{k + 2}/ack-{k}")
        if self.train:
            self.sync.take(f"pingpong/{step}/done")
        else:
            self.sync.signal(f"pingpong/{step}/done")


# -- the worker -----------------------------------------------------------------------------------

def _timed(sync: _Sync, device: torch.device, step, before=None) -> tuple[float, int]:
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


def _run_method(name: str, model: Any, sync: _Sync, job: dict, device: torch.device, train: bool,
                seed_base: int, bound: CopyBound | None) -> dict[str, Any]:
    from refit_core import RefitOptions, RefitReceiver, RefitSender

    iters, warmup = job["iters"], job["warmup"]
    out: dict[str, Any] = {"method": name}
    base = _allocated(device)
    _reset_peak(device)
    stats: list[Any] = []  # refit's StepStats (its own account of staged bytes)
    traces: list[dict[str, Any]] = []  # with --breakdown: each step's StepTrace, as a dict
    start = time.perf_counter()
    if name == "ping-pong":
        runner = PingPong(model, sync, device, train)
        step: Callable[[], Any] = runner.step
        out["shared_bytes"] = runner.shared_bytes if train else 0
        out["fills"] = len(runner.buckets)
    else:
        variant, _, extras = name.partition(":")[2].partition("+")
        flags = set(extras.split("+"))
        options = RefitOptions(timeout_s=job["timeout_s"],
                               colocate=Colocation.AUTO if device.type == "cuda" else Colocation.SHARED,
                               strided_copies=StridedCopy(variant or RefitOptions().strided_copies),
                               overlap_check="check-first" not in flags, confirm="confirm" in flags,
                               step_trace=job.get("breakdown", False))
        cls = RefitSender if train else RefitReceiver
        endpoint = cls(model, rendezvous=job["refit_address"], rank=0, world_size=1, options=options)
        endpoint.setup()
        links = sorted({link.value for link in endpoint.links.values()})
        out["links"] = links

        def step() -> None:
            if isinstance(endpoint, RefitSender):
                stats.append(endpoint.send(version=sync.rounds))
            else:
                stats.append(endpoint.receive())
            trace = endpoint.colocated_trace
            if trace is not None:
                traces.append({"marks": dict(trace.marks), "gpu_ms": dict(trace.gpu_ms)})
    out["setup_s"] = time.perf_counter() - start
    peaks = [_peak(device)]  # setup: buffers a method allocates once (ping-pong's pair, refit's own)
    times = []
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
    out["seconds"] = times[warmup:]
    if traces:
        out["traces"] = traces[warmup:]
    out["peak_extra_bytes"] = max(0, max(peaks) - base)
    if stats:
        out["staging_bytes"] = max(s.staging_bytes for s in stats)
    if not train:
        bad = model.mismatches(seed=seed_base + warmup + iters - 1)
        out["checks"] = ["bitwise ok"] if not bad else [f"{len(bad)} pieces differ, e.g. {bad[:3]}"]
    if name.startswith("refit"):
        if not train:  # copy launches per step after batching (bound at the first step)
            out["copies"] = endpoint.colocated_copies
            counts = endpoint.colocated_counts
            out["copy_counts"] = asdict(counts) if counts is not None else None
        endpoint.close()
        del endpoint
    else:
        del runner
    sync.barrier()
    return out


def _worker(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    train = rank == 0
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layouts.register()
    sync = _Sync(job["sync_address"], rank, job["timeout_s"])
    results = []
    for number, name in enumerate(job["models"]):
        path, variant = _model_entry(name)
        fit = fit_model(name, load_config(path), memory_budget(device, job.get("memory_gib")), job["bound_bytes"])
        if fit.skipped:
            results.append({"model": name, "skipped": fit.reason, "methods": []})
            continue
        config = fit.config(load_config(path))
        model: Any
        if train:
            model = TRAINERS[variant](config, tp=1, rank=0, device=device)
        else:
            block = job.get("fp8_block")
            model = layouts.VllmStyleModel(config, tp=1, rank=0, device=device,
                                           fp8_block=(block, block) if block else None)
            if block and device.type == "cuda":
                torch.cuda.empty_cache()  # the high-precision tensors the FP8 ones replaced: give them to the trainer
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
        results.append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"side": "train" if train else "gen", "models": results}


# -- the report -----------------------------------------------------------------------------------

def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, method): the trainer's median step, the fraction of the copy bound, memory."""
    train, gen = results
    rows = []
    for t_model, g_model in zip(train["models"], gen["models"]):
        if g_model.get("skipped"):
            continue
        bound = _median(g_model["methods"][0]["seconds"])
        problem = bound_rate_problem(g_model["bytes"], bound, g_model["device_name"])
        t_by = {m["method"]: m for m in t_model["methods"]}
        for g in g_model["methods"]:
            t = t_by.get(g["method"], g)
            seconds = _median(t["seconds"])
            ratio = check_ratio(bound / seconds if seconds else None, "copy bound", problem)
            rows.append({"model": g_model["model"], "method": g["method"], "bytes": g_model["bytes"],
                         "ms": 1000 * seconds, "of_bound": ratio.value if ratio.valid else None,
                         "of_bound_check": ratio.as_json(),
                         "gbps": g_model["bytes"] / seconds / 1e9 if seconds else 0.0,
                         "checks": g["checks"], "trainer_extra_bytes": t.get("peak_extra_bytes", 0),
                         "engine_extra_bytes": g.get("peak_extra_bytes", 0),
                         "shared_bytes": t.get("shared_bytes", 0), "setup_s": t.get("setup_s", 0.0),
                         "staging_bytes": {"trainer": t.get("staging_bytes"), "engine": g.get("staging_bytes")},
                         "info": {k: g[k] for k in ("links", "copies", "copy_counts", "fills", "chunk_bytes")
                                  if k in g}})
            if "traces" in t and "traces" in g:
                rows[-1]["breakdown_ms"] = _breakdown(t["traces"], g["traces"])
    return rows


def _breakdown(train: list[dict[str, Any]], gen: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each phase of :func:`~refit_core.run.timing.breakdown` over the timed steps."""
    steps = [breakdown(StepTrace(t["marks"], t["gpu_ms"]), StepTrace(g["marks"], g["gpu_ms"]))
             for t, g in zip(train, gen)]
    return {key: _median([s[key] for s in steps]) for key in steps[0]} if steps else {}


BREAKDOWN_NOTE = """
Breakdown columns (ms, medians; `refit_core.run.timing.breakdown`): `total` the trainer's `send`;
`check` its moved-parameter check; `post` writing *ready*; `signal` *ready* written -> the engine read
and checked it; `enqueue` the engine's host time queueing its copies; `device_wait` device time from
queueing to the stream passing its events; `device_contiguous` / `device_strided` / `device_batched`
each launch group's device time, `device_copies` their sum; `observe` copies' end -> the engine saw it;
`ack` the engine saw it -> the trainer read *done*; `tail` copies' end -> the trainer read *done*;
`after` the trainer's work after that. `strided MB`: bytes the large strided copies move.
"""

PHASES = ("total", "check", "post", "signal", "enqueue", "device_wait", "device_contiguous", "device_strided",
          "device_batched", "device_copies", "observe", "ack", "tail", "after")
"""The breakdown table's columns (ms; ``device_*`` on CUDA only)."""


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """The median phases of every traced refit row, one line each (ms)."""
    traced = [r for r in rows if r.get("breakdown_ms")]
    if not traced:
        return ""
    columns = [p for p in PHASES if any(p in r["breakdown_ms"] for r in traced)]
    lines = ["| model | method | " + " | ".join(columns) + " | launches | strided MB |",
             "|---|---|" + "---|" * len(columns) + "---|---|"]
    for r in traced:
        b = r["breakdown_ms"]
        counts = r["info"].get("copy_counts") or {}
        cells = " | ".join(f"{b[c]:.3f}" if c in b else "-" for c in columns)
        lines.append(f"| {r['model']} | {r['method']} | {cells} | {r['info'].get('copies', '-')} | "
                     f"{counts.get('strided_bytes', 0) / 1e6:.0f} |")
    return "\n".join(lines)


def _memory(peak: int, row: dict[str, Any]) -> str:
    """A process's extra memory: the measured peak (CUDA), else what refit says it staged (CPU)."""
    if peak or row["method"] != "refit" or row["staging_bytes"]["trainer"] is None:
        return f"{peak / GiB:.2f} GiB"
    staged = (row["staging_bytes"]["trainer"] or 0) + (row["staging_bytes"]["engine"] or 0)
    return f"{staged / GiB:.2f} GiB staged"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | method | GB | ms/step | of copy bound | GB/s | trainer extra | engine extra | launches "
             "| check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        info = r["info"]
        launches = info.get("copies", info.get("fills", "-"))
        lines.append(f"| {r['model']} | {r['method']} | {r['bytes'] / 1e9:.2f} | {r['ms']:.2f} | "
                     f"{Ratio.from_json(r['of_bound_check']).text()} | {r['gbps']:.0f} | "
                     f"{_memory(r['trainer_extra_bytes'], r)} | "
                     f"{_memory(r['engine_extra_bytes'], r)} | {launches} | {', '.join(r['checks'])} |")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m refit_core.tools.bench.colocated",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-3-8b-shape,qwen3-30b-a3b-shape",
                        help="comma-separated presets or config.json paths")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bound-gib", type=float, default=4.0,
                        help="the copy bound's chunk: it copies every byte through two buffers of this size")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="memory a shape may use, else it runs as a slice of its layers or is skipped "
                             "(default: the GPU's memory less 3 GiB; no limit on CPU)")
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    parser.add_argument("--machine", default="")
    parser.add_argument("--breakdown", action="store_true",
                        help="trace every timed refit step and print where its time goes")
    parser.add_argument("--fp8-block", type=int, metavar="N",
                        help="the engine holds block-FP8 linear weights in N x N blocks (refit quantizes)")
    parser.add_argument("--variants", action="store_true",
                        help="methods: copy-bound, refit:VARIANT for every StridedCopy and refit:+confirm, "
                             "with --breakdown")
    return parser.parse_args(argv)


def _available(methods: list[str], device: str) -> list[str]:
    """``methods`` without the variants this machine cannot run (said on stderr)."""
    if f"refit:{StridedCopy.MEMCPY2D.value}" in methods and device.startswith("cuda"):
        from refit_core.run.copies import cuda_memcpy2d

        try:
            cuda_memcpy2d()
        except (RuntimeError, OSError, AttributeError) as exc:
            print(f"skipping refit:{StridedCopy.MEMCPY2D.value}: {exc}", file=sys.stderr, flush=True)
            return [m for m in methods if m != f"refit:{StridedCopy.MEMCPY2D.value}"]
    return methods


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    models = [m for m in args.models.split(",") if m]
    for entry in models:
        _model_entry(entry)
    methods = ["copy-bound", *VARIANTS, CONFIRM] if args.variants else [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - {*METHODS, *VARIANTS, CONFIRM})
    if unknown:
        raise SystemExit(f"unknown methods {unknown}: choose from {[*METHODS, *VARIANTS, CONFIRM]}")
    device = "cuda:0" if args.device == "cuda" else args.device
    methods = _available(methods, device)
    if args.fp8_block and "ping-pong" in methods:
        print("skipping ping-pong: it does not quantize (--fp8-block)", file=sys.stderr, flush=True)
        methods.remove("ping-pong")
    job = {"models": models, "methods": methods, "device": device, "iters": args.iters, "warmup": args.warmup,
           "fp8_block": args.fp8_block, "memory_gib": args.memory_gib,
           "bound_bytes": int(args.bound_gib * GiB), "timeout_s": args.timeout_s,
           "breakdown": args.breakdown or args.variants,
           "sync_address": f"127.0.0.1:{free_port()}",
           "refit_addresses": [f"127.0.0.1:{free_port()}" for _ in range(len(models) * len(methods))]}
    start = time.perf_counter()
    results = spawn(_worker, 2, job, timeout_s=args.timeout_s * (1 + len(models)) + 60,
                    env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    rows = summarize(results)
    skipped = [m["skipped"] for m in results[1]["models"] if m.get("skipped")]
    report = {"skipped": skipped,"machine": args.machine, "device": device,
              "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "iters": args.iters, "fp8_block": args.fp8_block,
              "seconds": time.perf_counter() - start, "rows": rows}
    text = table(rows) + "".join(f"\n\n{reason}" for reason in skipped)
    phases = breakdown_table(rows)
    if phases:
        text += "\n\nWhere a refit step's time goes (median ms over the timed steps):\n\n" + phases
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(args.out + ".md", "w") as f:
            fp8 = f", engine in block FP8 ({args.fp8_block} x {args.fp8_block})" if args.fp8_block else ""
            f.write(f"# Colocated refit, {report['gpu']} ({args.machine or device}), one device, two processes{fp8}\n\n"
                    f"{text}\n\n`trainer extra` / `engine extra`: each process's peak allocation above its model "
                    "during the method's setup and steps (the benchmark's own weight fill excluded; the "
                    "trainer's includes the buffers it shares with the engine); on CPU, the bytes refit "
                    "reports staged. `of copy bound`: the median one-copy time of the same bytes (every byte, "
                    f"in chunks of at most {args.bound_gib:g} GiB, warm, at least {MIN_BOUND_SAMPLES} copies "
                    "interleaved with the methods' steps) divided by the method's step; INVALID when above "
                    "1.02 or when the bound is implausibly slow for the GPU. `NAME[K/N layers]`: a slice "
                    "of the shape (same per-layer shapes) that fits the GPU. `launches`: copy calls per step "
                    "(refit) or buffer fills (ping-pong).\n" + (BREAKDOWN_NOTE if phases else ""))
    ok = all(r["checks"] in (["bitwise ok"], ["-"]) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
