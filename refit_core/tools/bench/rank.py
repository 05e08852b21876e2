"""One rank of ``refit bench``: its side of the model, then every method timed in lockstep and checked.

Each method runs on all ranks together: a store barrier with the GPUs idle, then the step; a step's time
is the slowest rank's (the weights have landed when the last receiver is done). After each method the
gen side checks every byte against the values drawn again on its GPU (the wire and the broadcast, which
move the trainer's bytes in their own layout, are checked by a checksum instead), and reports the peak GPU
memory the method allocated beyond the model, and what was still allocated after it.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.plugins import PluginManager
from refit_core.kit.models import load_config
from refit_core.tools.bench.barrier import Barrier
from refit_core.tools.bench.copybound import sync_device
from refit_core.tools.bench.layouts import MegatronStyleModel, VllmStyleModel, register
from refit_core.tools.bench.methods import is_baseline, method_class, open_bench_comm
from refit_core.tools.bench.wire import checksum
from refit_core.tools.bench.wireplan import WirePlan, schedule_plan, single_pair

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off (it can take a shared host's GPUs down); set for every rank."""
WIRE_PLAN_KEY = "wire/plan"


@dataclass
class RankContext:
    """What a method sees of its rank: its side, device and model, the run's settings, the shared store
    and (one-to-one runs with a baseline, on the pair) the communicator the baselines use."""

    rank: int
    nprocs: int
    is_train: bool
    side_rank: int
    side_size: int
    device: torch.device
    model: Any
    model_bytes: int
    bucket_bytes: int | None
    num_buffers: int
    timeout_s: float
    ports: dict[str, int]
    plugins: PluginManager
    store: Any = None
    comm: Any = None
    wire_bytes: int = 0
    first_gen: int = 1
    extra: dict = field(default_factory=dict)

    @property
    def in_pair(self) -> bool:
        """True on the two ranks the wire and the baselines of a one-to-one run use (train 0, gen 0)."""
        return self.rank in (0, self.first_gen)

    def refit_address(self, method: str) -> str:
        return f"127.0.0.1:{self.ports[method]}"

    def wire_plan(self) -> WirePlan:
        """What the wire moves: a one-to-one run's model bytes over its pair, else refit's plan (which
        the first refit method published; the runner puts the wire after it)."""
        if self.nprocs == 2:
            return single_pair(0, self.first_gen, self.wire_bytes)
        return WirePlan.from_json(json.loads(self.store.get(WIRE_PLAN_KEY).decode()))


@dataclass
class _MemoryWatch:
    """A CUDA rank's memory around one method: what torch allocated beyond the model at the peak and
    after the steps, and what the method holds outside torch's allocator (NCCL's buffers)."""

    device: torch.device
    free_before: int = 0
    reserved_before: int = 0
    base: int = 0

    def before_setup(self) -> None:
        sync_device(self.device)
        self.free_before = torch.cuda.mem_get_info(self.device)[0]
        self.reserved_before = torch.cuda.memory_reserved(self.device)

    def before_steps(self) -> None:
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self) -> dict[str, int]:
        taken = self.free_before - torch.cuda.mem_get_info(self.device)[0]
        return {"peak_extra_bytes": torch.cuda.max_memory_allocated(self.device) - self.base,
                "after_extra_bytes": torch.cuda.memory_allocated(self.device) - self.base,
                "outside_torch_bytes": taken - (torch.cuda.memory_reserved(self.device) - self.reserved_before)}


def run_rank(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank`` of a bench run (train ranks first): its model's figures and every method's entry."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    ctx, barrier, build_s = _join(rank, nprocs, job)
    me = job["ranks"][rank]
    out: dict[str, Any] = {
        "rank": rank, "side": me["side"], "device": str(ctx.device), "tp": me["tp"], "tp_rank": me["tp_rank"],
        "device_name": (torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda"
                        else platform.processor() or "cpu"),
        "model_bytes": ctx.model.nbytes, "build_s": build_s, "methods": {},
    }
    for name in job["methods"]:
        out["methods"][name] = _time_method(name, ctx, barrier, job)
        barrier()
    if ctx.comm is not None:
        ctx.comm.close()
    barrier()
    barrier.leave(rank)
    return out


def _build_model(job: dict[str, Any], me: dict[str, Any], device: torch.device) -> tuple[Any, float]:
    """This rank's side of the model, filled (train) or poisoned (gen), and the seconds that took."""
    config = load_config(job["model"])
    start = time.perf_counter()
    model: Any
    if me["side"] == "train":
        model = MegatronStyleModel(config, tp=me["tp"], rank=me["tp_rank"], device=device)
        model.fill(job["seed"])
    else:
        fp8_block = tuple(job["fp8_block"]) if job.get("fp8_block") else None
        model = VllmStyleModel(config, tp=me["tp"], rank=me["tp_rank"], device=device, fp8_block=fp8_block)
        model.poison()
    sync_device(device)
    return model, time.perf_counter() - start


def _join(rank: int, nprocs: int, job: dict[str, Any]) -> tuple[RankContext, Barrier, float]:
    """Open the run's store, build the model and agree on the wire's bytes (the smaller of the pair's
    models) and, where the baselines run, their communicator; also the model's build seconds."""
    me = job["ranks"][rank]
    device = torch.device(me["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", job["port"], nprocs, rank == 0,
                          timeout=timedelta(seconds=job["timeout_s"]),
                          wait_for_workers=False, use_libuv=True)
    barrier = Barrier(store, nprocs)
    model, build_s = _build_model(job, me, device)
    is_train = me["side"] == "train"
    first_gen = job["num_train"]
    ctx = RankContext(rank, nprocs, is_train, me["side_rank"], first_gen if is_train else nprocs - first_gen,
                      device, model, model.nbytes, job["bucket_bytes"], job["num_buffers"], job["timeout_s"],
                      job["ports"], register(PluginManager(load_entry_points=False)), store=store,
                      first_gen=first_gen,
                      extra={"timeline": job.get("timeline", False), "ranks": job["ranks"],
                             "devices": {r: spec["device"] for r, spec in enumerate(job["ranks"])}})
    store.set(f"bytes/{rank}", str(model.nbytes))
    barrier()
    ctx.wire_bytes = min(int(store.get(f"bytes/{r}").decode()) for r in (0, first_gen))
    if nprocs == 2 and any(is_baseline(m) for m in job["methods"]) and ctx.in_pair:
        ctx.comm = open_bench_comm(store, "bench", 2, 0 if is_train else 1, device)
    barrier()
    return ctx, barrier, build_s


def _time_method(name: str, ctx: RankContext, barrier: Barrier, job: dict[str, Any]) -> dict[str, Any]:
    """Set ``name`` up, time its steps and check what landed: this rank's entry for the method."""
    method: Any = method_class(name)(ctx)
    takes_part = not is_baseline(name) or ctx.in_pair or name.startswith("wire")
    barrier()
    memory = _MemoryWatch(ctx.device) if ctx.device.type == "cuda" else None
    if memory is not None:
        memory.before_setup()
    if takes_part:
        method.setup()
    if name.startswith("refit") and ctx.rank == 0 and ctx.nprocs > 2 and ctx.store.add("wire/planned", 1) == 1:
        ctx.store.set(WIRE_PLAN_KEY, json.dumps(schedule_plan(method.schedule, ctx.first_gen).to_json()))
    barrier()
    if not ctx.is_train:
        ctx.model.poison()
    gc.collect()
    sync_device(ctx.device)
    if memory is not None:
        memory.before_steps()
    times, own = _timed_steps(name, method if takes_part else None, ctx, barrier, job)
    gc.collect()
    sync_device(ctx.device)
    entry: dict[str, Any] = {"times_s": times, "own_times_s": own, "warmup": job["warmup"],
                             "info": dict(method.info)}
    if memory is not None:
        entry.update(memory.figures())
    check = _check(name, method, ctx, job) if takes_part else None
    if check is not None:
        entry["check"] = check
    if name.startswith("refit") and takes_part:
        if ctx.rank == 0:
            entry["links"] = _link_bytes(method.schedule, job)
        entry.update(method.recorded())
    if takes_part:
        method.close()
    return entry


def _timed_steps(name: str, method: Any, ctx: RankContext, barrier: Barrier,
                 job: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Every step's time (the slowest rank's) and this rank's own, until ``iters`` steps after the
    warm-up, or earlier once ``min_iters`` timed steps took over ``budget_s``; ``method`` None: this
    rank takes no part (a baseline off the pair) and only keeps the lockstep."""
    times: list[float] = []
    own: list[float] = []
    for i in range(job["warmup"] + job["iters"]):
        sync_device(ctx.device)
        barrier()
        t0 = time.perf_counter()
        if method is not None:
            method.step(i)
        sync_device(ctx.device)
        elapsed = time.perf_counter() - t0
        own.append(elapsed)
        times.append(barrier.max(f"t/{name}/{i}", ctx.rank, elapsed))
        timed = times[job["warmup"]:]
        if len(timed) >= job["min_iters"] and sum(timed) > job["budget_s"]:
            break
    return times, own


def _check(name: str, method: Any, ctx: RankContext, job: dict[str, Any]) -> str | None:
    """What this rank, which took part in ``name``, says of the bytes that landed (None: nothing, as on a
    train rank)."""
    if method.checked_by_checksum:
        check = method.verify(checksum)
        return check if check is not None and method.lanes else None
    if ctx.is_train:
        return None
    bad = ctx.model.mismatches(job["seed"])
    last = job["warmup"] + job["iters"] - 1
    if name.startswith("refit") and ctx.model.version != last and not bad:
        return f"version {ctx.model.version} != {last}"
    return "bitwise ok" if not bad else f"{len(bad)} MISMATCHED: {bad[:3]}"


def _link_bytes(schedule: Any, job: dict[str, Any]) -> dict[str, int]:
    """The bytes refit's schedule moves over each device link (``cuda:0->cuda:1``)."""
    ranks = job["ranks"]
    first_gen = job["num_train"]
    links: dict[str, int] = {}
    for msgs in schedule.rounds:
        for m in msgs:
            key = f"{ranks[m.src]['device']}->{ranks[first_gen + m.dst]['device']}"
            links[key] = links.get(key, 0) + m.nbytes
    return links


__all__ = ["SAFE_ENV", "WIRE_PLAN_KEY", "RankContext", "run_rank"]
