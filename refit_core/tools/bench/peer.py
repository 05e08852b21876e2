"""checkpoint-engine (the real peer, driven through its own API) beside refit, same shapes, same bytes.

``python -m refit_core.tools.bench.peer --gpus 1 --models llama-3-8b-shape,qwen3-30b-a3b-shape --out PREFIX``
(``benchmarks/peer_checkpoint_engine.py`` is the same entry; ``STEPS=peer`` / ``STEPS=peer2`` of
``benchmarks/run_gpu.sh`` install the carried wheels and run it).

The trainer holds a Megatron-style model, the engine a vLLM-style one (:mod:`refit_core.tools.bench.layouts`).

- ``checkpoint-engine`` (``--gpus 1``: colocated, one GPU): the trainer process is
  ``ParameterServer`` rank 0 (world 1) and registers the trainer's HF tensors each step
  (``register_checkpoint(named_tensors=..., use_shared_memory_pool=True)``: its pinned host pool,
  reused), then ``gather_metas`` and, timed, ``update(name, req_func)`` (``ranks=None``: its broadcast
  path). ``req_func`` hands the ZMQ address to the engine, a SECOND process, which runs
  ``checkpoint_engine.worker.update_weights_from_ipc`` with a loader that copies each HF tensor into
  its place in the engine's tensors (what vLLM's ``load_weights`` does).
- ``checkpoint-engine`` (``--gpus 2``: its NCCL broadcast): ``ParameterServer`` rank 0 on GPU 0 holds the
  checkpoint, rank 1 on GPU 1 holds none; ``update`` broadcasts every bucket from rank 0 to rank 1,
  whose engine process on GPU 1 loads it; rank 0's own worker (GPU 0, no engine there) acknowledges
  each bucket without loading. Four processes: trainer, engine, PS rank 1, rank 0's worker.
- ``refit``: :class:`~refit_core.RefitSender` / :class:`~refit_core.RefitReceiver` with default options.
- the bound: ``copy-bound`` on one GPU (one device copy of the same bytes,
  :class:`~refit_core.tools.bench.copybound.CopyBound`), ``wire`` on two (one NCCL send of the same
  bytes GPU 0 -> GPU 1). Every ``of bound`` goes through :func:`~refit_core.tools.bench.validity.check_ratio`.

checkpoint-engine starts from host memory by design: its ``h2d`` is the time of its own host-to-device
step (``ParameterServer._copy_to_buffer``, which ends in a device synchronize) summed over the
buckets, and ``gpu part`` is its end-to-end time less that: what it would take once the weights are
on the GPU. Its H2D of bucket i+1 overlaps the engine's load of bucket i, so ``gpu part`` is a lower
bound (generous to checkpoint-engine). ``register`` (host copy) and ``gather_metas`` are reported,
not timed into ``update``. Its settings are its documented defaults (``auto_pg=True``,
``PS_MEM_FRACTION`` 0.9, ``PS_MAX_BUCKET_SIZE_GB`` 8, torch NCCL backend) and are printed with the
bucket size it chose. Each step: all ranks meet at a barrier, every participating rank times to its
end (device synchronized), the step is the largest; after ``--warmup`` steps, ``--iters`` timed steps,
the methods interleaved step by step. Each method's last step is checked bitwise on the engine
(weights poisoned first). Writes ``PREFIX.json`` and ``PREFIX.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.errors import RefitError
from refit_core.kit.launch import RankFailure, free_port, spawn
from refit_core.kit.models import load_config
from refit_core.tools.bench import layouts
from refit_core.tools.bench.colocated import memory_budget
from refit_core.tools.bench.copybound import CopyBound
from refit_core.tools.bench.fit import Fit, fit_layers
from refit_core.tools.bench.barrier import Barrier
from refit_core.tools.bench.comms import open_bench_comm
from refit_core.tools.bench.hftensors import hf_tensors, materialize, scatter
from refit_core.tools.bench.validity import Ratio, bound_rate_problem, check_ratio
from refit_core.tools.bench.wire import checksum

GiB = 1 << 30
CE = "checkpoint-engine"
REFIT = "refit"
METHODS = (CE, REFIT)
CE_MAX_BUCKET = 8 * GiB
"""checkpoint-engine's default largest bucket (``PS_MAX_BUCKET_SIZE_GB``); it holds three (H2D buffer
and a double buffer) on each GPU during ``update``."""
CHECKPOINT = "bench"


class Role:
    """The processes of a run, by rank: 0 trainer, 1 engine; with two GPUs also 2 (checkpoint-engine's
    rank 1, on the engine's GPU) and 3 (the acknowledging worker of its rank 0, on the trainer's GPU)."""

    TRAINER, ENGINE, PS1, ACK0 = 0, 1, 2, 3


@dataclass(frozen=True)
class Layout:
    """Where each rank runs: ``gpus`` 1 (everything on device 0) or 2 (trainer side on 0, engine side on 1)."""

    gpus: int

    @property
    def nprocs(self) -> int:
        return 2 if self.gpus == 1 else 4

    @property
    def bound(self) -> str:
        return "copy-bound" if self.gpus == 1 else "wire"

    def device_index(self, rank: int) -> int:
        return 0 if self.gpus == 1 or rank in (Role.TRAINER, Role.ACK0) else 1

    def ps_rank(self, rank: int) -> int | None:
        """checkpoint-engine's rank of the ``ParameterServer`` this process runs (None: none)."""
        return {Role.TRAINER: 0, Role.PS1: 1}.get(rank) if self.gpus == 2 or rank == Role.TRAINER else None

    def worker_of(self, rank: int) -> int | None:
        """The ``ParameterServer`` rank whose IPC worker this process is (None: not a worker)."""
        if self.gpus == 1:
            return 0 if rank == Role.ENGINE else None
        return {Role.ENGINE: 1, Role.ACK0: 0}.get(rank)


def needed_bytes(model_bytes: int, layout: Layout, bound_bytes: int) -> int:
    """GPU memory of the fullest device: a model (twice on one GPU, with 10% working memory), the bound's
    buffers (two copy-bound chunks; the wire's buffer of the model's size) and checkpoint-engine's three
    buckets."""
    ce = 3 * min(CE_MAX_BUCKET, model_bytes) + 2 * GiB
    if layout.gpus == 1:
        return int(2.2 * model_bytes) + 2 * min(model_bytes, bound_bytes) + ce
    return int(2.2 * model_bytes) + ce


def fit_model(name: str, config: dict[str, Any], budget: int | None, layout: Layout, bound_bytes: int) -> Fit:
    return fit_layers(name, config, budget, lambda n: needed_bytes(n, layout, bound_bytes))


# -- checkpoint-engine's two sides ------------------------------------------------------------------

def hf_state(model: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The trainer's weights as a HF state dict (per-expert names), what a trainer registers."""
    return {spec.name: materialize(spec, parts, device) for spec, parts in hf_tensors(model)}


def engine_loader(model: Any) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """A ``load_weights`` for the vLLM-style engine: each named HF tensor into its places."""
    parts = {spec.name: p for spec, p in hf_tensors(model)}

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name not in parts:
                raise KeyError(f"the engine holds no tensor named {name!r}")
            scatter(tensor, parts[name])
    return load


def _ignore(weights: list[tuple[str, torch.Tensor]]) -> None:
    """The loader of checkpoint-engine rank 0's worker in the two-GPU run: no engine on the trainer's GPU."""


def _device_uuid(device: torch.device) -> str:
    """The name checkpoint-engine gives a GPU in ``req_func``'s socket paths."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid!s}"


class CeServer:
    """One ``ParameterServer`` rank, with its host-to-device time and chosen bucket recorded per update."""

    def __init__(self, rank: int, world: int, address: tuple[str, int], device: torch.device, store: Any) -> None:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)  # it reads them when rank is 0
        import checkpoint_engine.ps as ce_ps

        try:
            ce_ps.get_ip()
            self.ip_note = ""
        except OSError as exc:  # no route and no resolvable hostname: only its metadata holds the address
            ce_ps.get_ip = lambda: "127.0.0.1"
            self.ip_note = f"get_ip failed ({exc}): 127.0.0.1 given"
        self.rank, self.store, self.device = rank, store, device
        self.ps = ce_ps.ParameterServer(rank=rank, world_size=world, master_addr=address[0], master_port=address[1])
        self.h2d: list[float] = []
        self.buckets: list[tuple[int, bool]] = []
        copy, detect = self.ps._copy_to_buffer, self.ps._detect_bucket_size

        def timed_copy(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            copy(*args, **kwargs)
            self.h2d.append(time.perf_counter() - start)

        def recorded_detect(*args: Any, **kwargs: Any) -> tuple[int, bool]:
            out = detect(*args, **kwargs)
            self.buckets.append(out)
            return out

        self.ps._copy_to_buffer, self.ps._detect_bucket_size = timed_copy, recorded_detect
        self.uuid: str = getattr(self.ps, "_device_uuid", None) or _device_uuid(device)

    def register(self, state: dict[str, torch.Tensor] | None) -> None:
        if state is not None:
            self.ps.register_checkpoint(CHECKPOINT, named_tensors=state, use_shared_memory_pool=True)
        self.ps.gather_metas(CHECKPOINT)

    def update(self, key: str) -> float:
        """One timed ``update``; returns its host-to-device seconds."""
        self.h2d = []

        def req_func(socket_paths: list[tuple[str, str]]) -> None:
            paths = dict(socket_paths)
            if self.uuid not in paths:  # said before the server waits for a worker that never comes
                print(f"checkpoint-engine rank {self.rank}: no socket path for {self.uuid} in {sorted(paths)}",
                      file=sys.stderr, flush=True)
                os._exit(3)
            self.store.set(key, paths[self.uuid])

        self.ps.update(CHECKPOINT, req_func)
        return sum(self.h2d)

    def release(self, last: bool) -> None:
        if self.rank == 0:
            self.ps.unregister_checkpoint(CHECKPOINT, force=last)


def ce_receive(store: Any, key: str, device: torch.device, load: Callable, zmq_ctx: Any) -> None:
    """The engine side of one ``update``: wait for its address, then checkpoint-engine's own receiver."""
    from checkpoint_engine.worker import update_weights_from_ipc

    store.wait([key])
    handle = store.get(key).decode()
    update_weights_from_ipc(zmq_ctx, handle, device.index, run=load)


def ce_settings(server: CeServer | None) -> dict[str, Any]:
    import checkpoint_engine

    out: dict[str, Any] = {"version": checkpoint_engine.__version__, "auto_pg": True, "ranks": None,
                           "PS_MEM_FRACTION": os.environ.get("PS_MEM_FRACTION", "0.9 (default)"),
                           "PS_MAX_BUCKET_SIZE_GB": os.environ.get("PS_MAX_BUCKET_SIZE_GB", "8 (default)"),
                           "backend": "torch nccl (default)", "use_shared_memory_pool": True}
    if server is not None:
        sizes = sorted({b for b, _ in server.buckets})
        out["bucket_bytes"] = sizes
        out["h2d_buffer"] = sorted({not disabled for _, disabled in server.buckets})
        if server.ip_note:
            out["note"] = server.ip_note
    return out


# -- one run ----------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Run:
    """One process's part: its models, the methods it takes part in and the step loop."""

    def __init__(self, rank: int, job: dict[str, Any]) -> None:
        self.rank, self.job = rank, job
        self.layout = Layout(job["gpus"])
        cuda = job["device"] == "cuda"
        self.device = torch.device("cuda", self.layout.device_index(rank)) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        host, port = job["sync_address"].rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=rank == 0,
                                   timeout=timedelta(seconds=job["timeout_s"]), wait_for_workers=False)
        self.barrier = Barrier(self.store, self.layout.nprocs)
        self.methods: list[str] = job["methods"]
        self.server: CeServer | None = None
        self.zmq_ctx: Any = None
        if CE in self.methods:
            self._open_ce()

    def _open_ce(self) -> None:
        ps_rank = self.layout.ps_rank(self.rank)
        if ps_rank is not None:
            host, port = self.job["ce_address"].rsplit(":", 1)
            self.server = CeServer(ps_rank, self.layout.gpus, (host, int(port)), self.device, self.store)
        if self.layout.worker_of(self.rank) is not None:
            import zmq

            self.zmq_ctx = zmq.Context()

    def close(self) -> None:
        """End checkpoint-engine's ZMQ contexts now (linger 0), so that no exit waits on them."""
        contexts = [self.zmq_ctx, getattr(self.server.ps, "_zmq_ctx", None) if self.server is not None else None]
        for context in contexts:
            if context is not None:
                context.destroy(linger=0)
        self.server = self.zmq_ctx = None

    def log(self, text: str) -> None:
        if self.rank == Role.TRAINER:
            print(f"[peer {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    def timed(self, key: str, work: Callable[[], Any]) -> float:
        """``work`` from a common barrier to its end on this rank; the largest over the ranks."""
        self.barrier()
        start = time.perf_counter()
        work()
        _sync(self.device)
        return self.barrier.max(key, self.rank, time.perf_counter() - start)

    def model(self, number: int, name: str) -> dict[str, Any]:
        job, layout = self.job, self.layout
        config = load_config(name)
        budget = memory_budget(self.device, job.get("memory_gib")) if self.device.type == "cuda" else None
        fit = fit_model(name, config, budget, layout, job["bound_bytes"])
        if fit.skipped:
            return {"model": name, "skipped": fit.reason}
        config = fit.config(config)
        trainer = engine = None
        if self.rank == Role.TRAINER:
            trainer = layouts.MegatronStyleModel(config, tp=1, rank=0, device=self.device)
        if self.rank == Role.ENGINE:
            engine = layouts.VllmStyleModel(config, tp=1, rank=0, device=self.device)
        self.log(f"{fit.label}: methods {self.methods}, bound {layout.bound}")
        return self._steps(number, fit, trainer, engine)

    def _steps(self, number: int, fit: Fit, trainer: Any, engine: Any) -> dict[str, Any]:
        job, layout, rank = self.job, self.layout, self.rank
        from refit_core import RefitOptions, RefitReceiver, RefitSender

        refit = None
        if REFIT in self.methods and rank in (Role.TRAINER, Role.ENGINE):
            cls = RefitSender if rank == Role.TRAINER else RefitReceiver
            refit = cls(trainer if rank == Role.TRAINER else engine, rendezvous=job["refit_addresses"][number],
                        rank=0, world_size=1, options=RefitOptions(timeout_s=job["timeout_s"]))
            refit.setup()
        self.barrier()
        bound: Any = None
        nbytes = self.model_bytes(number, trainer)
        if layout.gpus == 1 and rank == Role.ENGINE:
            bound = CopyBound(nbytes, self.device, job["bound_bytes"])
        wire = self._open_wire(number, nbytes) if layout.gpus == 2 and rank in (Role.TRAINER, Role.ENGINE) else None
        load = engine_loader(engine) if engine is not None else _ignore
        times: dict[str, list[float]] = {m: [] for m in [*self.methods, layout.bound]}
        ce: dict[str, list[float]] = {"h2d": [], "register": [], "gather_metas": []}
        checks: dict[str, str] = {}
        steps = job["warmup"] + job["iters"]
        for i in range(steps):
            seed, last, timed = 1000 * number + i, i == steps - 1, i >= job["warmup"]
            if trainer is not None:
                trainer.fill(seed=seed)
            for method in self.methods:
                if last and engine is not None:
                    engine.poison()
                seconds = self._step(method, number, i, trainer, load, ce, refit, last)
                if timed:
                    times[method].append(seconds)
                if last and engine is not None:
                    bad = engine.mismatches(seed=seed)
                    checks[method] = "bitwise ok" if not bad else f"{len(bad)} pieces differ, e.g. {bad[:3]}"
            if layout.gpus == 2:
                seconds = self.timed(f"wire/{number}/{i}", wire.step if wire is not None else lambda: None)
                if timed:
                    times["wire"].append(seconds)
            else:
                self.barrier()  # the copy bound, the others idle
                if bound is not None and timed:
                    bound.sample()
                self.barrier()
            self.log(f"{fit.label} step {i + 1}/{steps}: " + ", ".join(
                f"{m} {1000 * t[-1]:.2f} ms" for m, t in times.items() if t and m != layout.bound and timed))
        if bound is not None:
            times["copy-bound"] = bound.samples
            bound.close()
        if wire is not None:
            checks["wire"] = wire.check(self.store, f"peer-wire/{number}/checksum", self.rank == Role.TRAINER)
        if refit is not None:
            refit.close()
        settings = ce_settings(self.server) if CE in self.methods and self.rank == Role.TRAINER else None
        if self.server is not None:
            self.server.release(last=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"model": fit.label, "bytes": nbytes, "times": times, "ce": ce, "checks": checks,
                "ce_settings": settings,
                "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}

    def model_bytes(self, number: int, trainer: Any) -> int:
        """The model's bytes, published by the trainer (the other ranks may hold no model)."""
        key = f"bytes/{number}"
        if trainer is not None:
            self.store.set(key, str(trainer.nbytes))
        self.store.wait([key])
        return int(self.store.get(key).decode())

    def _step(self, method: str, number: int, i: int, trainer: Any, load: Callable, ce: dict[str, list[float]],
              refit: Any, last: bool) -> float:
        if method == REFIT:
            def work() -> None:
                if self.rank == Role.TRAINER:
                    refit.send(version=i)
                elif self.rank == Role.ENGINE:
                    refit.receive()
            return self.timed(f"refit/{number}/{i}", work)
        # checkpoint-engine: register (host copy) and gather metas untimed, then the timed update
        server = self.server
        if server is not None:
            start = time.perf_counter()
            state = hf_state(trainer, self.device) if trainer is not None else None
            server.register(state)
            del state
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the gathered tensors: checkpoint-engine sizes its buckets by free memory
            if self.rank == Role.TRAINER:
                ce["register"].append(time.perf_counter() - start)
        h2d: list[float] = []
        worker = self.layout.worker_of(self.rank)
        key = f"ce/{number}/{i}"

        def update() -> None:
            if server is not None:
                h2d.append(server.update(f"{key}/{server.rank}"))
            if worker is not None:
                ce_receive(self.store, f"{key}/{worker}", self.device, load, self.zmq_ctx)
        seconds = self.timed(f"ce/{number}/{i}", update)
        if self.rank == Role.TRAINER and i >= self.job["warmup"]:
            ce["h2d"].append(h2d[0])
        if server is not None and not last:
            server.release(last=False)  # the shared pinned pool stays for the next registration
        return seconds

    def _open_wire(self, number: int, nbytes: int) -> Wire:
        comm = open_bench_comm(self.store, f"peer-wire/{number}", 2, 0 if self.rank == Role.TRAINER else 1,
                               self.device)
        return Wire(comm, nbytes, self.device, self.rank == Role.TRAINER)


class Wire:
    """The two-GPU bound: one NCCL send of the model's bytes, trainer -> engine, in one buffer."""

    def __init__(self, comm: Any, nbytes: int, device: torch.device, sender: bool) -> None:
        self.comm, self.sender = comm, sender
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if sender:
            self.buffer.random_(0, 256)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def step(self) -> None:
        if self.sender:
            self.comm.post([(1, self.buffer)], [], self.stream)
        else:
            self.comm.post([], [(0, self.buffer)], self.stream)

    def check(self, store: Any, key: str, publish: bool) -> str:
        """The receiver's checksum against the sender's (published under ``key``); closes the communicator."""
        total = checksum(self.buffer)
        if publish:
            store.set(key, str(total))
        store.wait([key])
        ok = int(store.get(key).decode()) == total
        self.comm.close()
        return "checksum ok" if ok else "CHECKSUM MISMATCH"


def _worker(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    layouts.register()
    run = _Run(rank, job)
    models = [run.model(n, name) for n, name in enumerate(job["models"])]
    run.barrier()
    run.close()
    run.barrier.leave(rank)
    return {"rank": rank, "models": models}


# -- the report -------------------------------------------------------------------------------------

def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _merge(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: the trainer's times (every rank agreed on each step's largest) and the engine's checks."""
    by_rank = {r["rank"]: r for r in results}
    merged = []
    for t, g in zip(by_rank[Role.TRAINER]["models"], by_rank[Role.ENGINE]["models"]):
        if "skipped" in t:
            merged.append(t)
            continue
        merged.append(dict(t, checks={**t["checks"], **g["checks"]}, times={**t["times"], **{
            k: v for k, v in g["times"].items() if k == "copy-bound"}}))
    return merged


def summarize(models: list[dict[str, Any]], bound: str) -> list[dict[str, Any]]:
    """One row per (model, method): median ms, the ratio of the bound, GB/s, checkpoint-engine's parts."""
    rows = []
    for m in models:
        if "skipped" in m:
            continue
        times, nbytes = m["times"], m["bytes"]
        bound_s = _median(times.get(bound, []))
        problem = bound_rate_problem(nbytes, bound_s, m["device_name"]) if bound == "copy-bound" else None
        if bound_s != bound_s:
            problem = f"{bound} not measured"
        refit_s = _median(times.get(REFIT, []))
        for method in [bound, *[k for k in METHODS if k in times]]:
            seconds = _median(times[method])
            row = {"model": m["model"], "method": method, "bytes": nbytes, "ms": 1000 * seconds,
                   "of_bound": check_ratio(bound_s / seconds if seconds else None, bound, problem).as_json(),
                   "gbps": nbytes / seconds / 1e9 if seconds else 0.0, "check": m["checks"].get(method, "-"),
                   "samples": len(times[method])}
            if method == CE:
                parts = [t - h for t, h in zip(times[CE], m["ce"]["h2d"])]
                gpu = _median(parts)
                row.update(h2d_ms=1000 * _median(m["ce"]["h2d"]), gpu_part_ms=1000 * gpu,
                           gpu_part_of_bound=check_ratio(bound_s / gpu if gpu > 0 else None, bound, problem).as_json(),
                           h2d_gbps=nbytes / _median(m["ce"]["h2d"]) / 1e9 if m["ce"]["h2d"] else 0.0,
                           register_s=_median(m["ce"]["register"]), settings=m.get("ce_settings"))
                if refit_s == refit_s and refit_s > 0:
                    row.update(refit_speedup=seconds / refit_s, refit_speedup_gpu_part=gpu / refit_s)
            rows.append(row)
    return rows


def _ms(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def table(rows: list[dict[str, Any]], bound: str) -> str:
    lines = [f"| model | method | GB | ms/step | of {bound} | GB/s | h2d ms | gpu part ms | gpu part of {bound} "
             "| refit faster x (end to end / gpu part) | check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ce = r["method"] == CE
        speed = (f"{r['refit_speedup']:.2f} / {r['refit_speedup_gpu_part']:.2f}"
                 if "refit_speedup" in r else "-")
        lines.append(
            f"| {r['model']} | {r['method']} | {r['bytes'] / 1e9:.2f} | {r['ms']:.2f} | "
            f"{Ratio.from_json(r['of_bound']).text()} | {r['gbps']:.0f} | "
            f"{_ms(r, 'h2d_ms')} | {_ms(r, 'gpu_part_ms')} | "
            f"{Ratio.from_json(r['gpu_part_of_bound']).text() if ce else '-'} | {speed} | {r['check']} |")
    return "\n".join(lines)


NOTE = """
`{bound}`: {bound_text}. `of {bound}`: the bound's median divided by the method's (check_ratio: INVALID
above 1.02{rate}). checkpoint-engine: `ms/step` is its `ParameterServer.update` end to end, from host
memory (its design); `h2d ms` its own host-to-device step (`_copy_to_buffer`, summed over buckets);
`gpu part` = end to end less h2d (a lower bound: its H2D of one bucket overlaps the engine's load of the
previous one). `refit faster x`: checkpoint-engine's time / refit's, end to end and from the GPU part.
Not timed: `register_checkpoint` (the trainer's copy into pinned host memory, `register s` in the JSON)
and `gather_metas`. Every step: all ranks at a barrier, each times to its end (device synchronized), the
largest counts; median of the timed steps, methods interleaved step by step after the warm-up.
"""


def note(layout: Layout, settings: dict[str, Any] | None) -> str:
    if layout.gpus == 1:
        text = NOTE.format(bound="copy-bound", rate=", or when the bound is implausibly slow for the GPU",
                           bound_text="one device copy of the same bytes in chunks, warm, interleaved")
    else:
        text = NOTE.format(bound="wire", rate="",
                           bound_text="one NCCL send of the same bytes, GPU 0 -> GPU 1, interleaved")
    if settings:
        text += "\ncheckpoint-engine settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "\n"
    return text


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m refit_core.tools.bench.peer", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                        help="1: colocated on GPU 0; 2: trainer on GPU 0, engine on GPU 1 (its NCCL broadcast)")
    parser.add_argument("--models", default="llama-3-8b-shape,qwen3-30b-a3b-shape")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"from {METHODS} (the bound always runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bound-gib", type=float, default=4.0, help="the copy bound's chunk (one GPU)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="memory a shape may use on the fullest GPU (default: the GPU's less 3 GiB)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    parser.add_argument("--machine", default="")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {list(METHODS)}")
    if args.iters < 5:
        parser.error("--iters must be at least 5 (a median of at least 5 interleaved steps)")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")
    if args.device == "cpu" and CE in args.methods:
        parser.error("checkpoint-engine needs CUDA: on CPU pass --methods refit")
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus} needs {args.gpus} GPUs, this machine has {torch.cuda.device_count()}")
    return args


def preflight(methods: list[str]) -> None:
    """Fail before any process starts if checkpoint-engine is wanted and cannot be imported."""
    if CE not in methods:
        return
    try:
        import checkpoint_engine.worker  # noqa: F401
    except Exception as exc:  # any import failure (a missing dependency, a broken wheel) is named
        raise SystemExit(f"checkpoint-engine does not import ({type(exc).__name__}: {exc}): install its wheels "
                         "(benchmarks/run_gpu.sh STEPS=peer does, from .whl-peer/)") from exc


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    preflight(args.methods)
    layout = Layout(args.gpus)
    models = [m for m in args.models.split(",") if m]
    for name in models:  # a bad name is said before any process starts
        try:
            load_config(name)
        except RefitError as exc:
            raise SystemExit(str(exc)) from exc
    print(f"peer bench: {args.gpus} GPU(s), models {models}, methods {args.methods} + {layout.bound}, "
          f"{args.warmup} warm-up + {args.iters} timed steps", file=sys.stderr, flush=True)
    start = time.perf_counter()
    merged: list[dict[str, Any]] = []
    failed: list[str] = []
    for name in models:  # one run per model: a shape that fails is named and the next one runs
        job = {"gpus": args.gpus, "models": [name], "methods": args.methods, "device": args.device,
               "iters": args.iters, "warmup": args.warmup, "bound_bytes": int(args.bound_gib * GiB),
               "memory_gib": args.memory_gib, "timeout_s": args.timeout_s,
               "sync_address": f"127.0.0.1:{free_port()}", "ce_address": f"127.0.0.1:{free_port()}",
               "refit_addresses": [f"127.0.0.1:{free_port()}"]}
        try:
            merged += _merge(spawn(_worker, layout.nprocs, job, timeout_s=args.timeout_s + 90,
                                   env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}))
        except RankFailure as exc:
            failed.append(f"{name} failed: {str(exc)[-3000:]}")
            print(failed[-1], file=sys.stderr, flush=True)
        _report(args, layout, merged, failed, time.perf_counter() - start)
    return 0 if merged and not failed and _all_checked(summarize(merged, layout.bound)) else 1


def _all_checked(rows: list[dict[str, Any]]) -> bool:
    return all(r["check"] in ("bitwise ok", "checksum ok", "-") for r in rows)


def _report(args: argparse.Namespace, layout: Layout, merged: list[dict[str, Any]], failed: list[str],
            seconds: float) -> None:
    """Print the table and write ``--out``'s files (again after every model: what ran is kept)."""
    rows = summarize(merged, layout.bound)
    skipped = [m["skipped"] for m in merged if "skipped" in m]
    settings = next((m.get("ce_settings") for m in merged if m.get("ce_settings")), None)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {"machine": args.machine, "gpu": device, "gpus": args.gpus, "torch": torch.__version__,
              "iters": args.iters, "warmup": args.warmup, "ce_settings": settings, "skipped": skipped,
              "failed": failed, "seconds": seconds, "rows": rows, "raw": merged}
    text = table(rows, layout.bound) + "".join(f"\n\n{reason}" for reason in skipped)
    text += "".join(f"\n\n{line.splitlines()[0]} (the traceback is in the JSON)" for line in failed)
    print(text, flush=True)
    if not args.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(args.out + ".md", "w") as f:
        where = "colocated, one GPU, two processes" if args.gpus == 1 else "GPU 0 -> GPU 1, four processes"
        f.write(f"# checkpoint-engine beside refit, {device} ({args.machine or args.device}), {where}\n\n"
                f"{text}\n{note(layout, settings)}")


if __name__ == "__main__":
    raise SystemExit(main())
