"""``refit bench``: wire vs. baselines vs. refit, same model, same bytes, one run, checked bitwise.

One process per rank (train ranks first, then gen ranks), each building its side of the model on its
own GPU with random weights. Every method runs in lockstep on all ranks: a store barrier with the GPUs
idle, then the step; a step's time is the slowest rank's (the weights have landed when the last
receiver is done), the method's time the median over the timed steps. After each method the gen side
checks every byte against the values drawn again on its GPU (the wire, which moves the trainer's bytes
in its own layout, is checked by a checksum instead), and reports the peak GPU memory the method
allocated beyond the model, and what was still allocated after it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.env import values_of
from refit_core.contract.plugins import PluginManager
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import PRESETS, checkpoint_specs, load_config
from refit_core.tools.bench.fp8 import fp8_comparison, fp8_methods, fp8_table
from refit_core.tools.bench.layouts import MegatronStyleModel, VllmStyleModel, register
from refit_core.tools.bench.methods import METHODS, method_class, open_bench_comm
from refit_core.tools.bench.validity import Ratio, check_ratio
from refit_core.tools.bench.wireplan import WirePlan, schedule_plan, single_pair

GiB = 1 << 30
MiB = 1 << 20
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off (it can take a shared host's GPUs down); set for every rank."""
BASELINES = ("wire", "per-tensor", "packed")


def _is_baseline(name: str) -> bool:
    return name.split("@")[0] in BASELINES
DEFAULT_MODELS = "llama-3-8b-shape,qwen3-30b-a3b-shape"
DEFAULT_METHODS = "wire,per-tensor,packed,refit"
WIRE_PLAN_KEY = "wire/plan"


# -- inside a rank ----------------------------------------------------------------------------------

class _Barrier:
    def __init__(self, store: dist.Store, nprocs: int) -> None:
        self.store, self.nprocs, self.count = store, nprocs, 0

    def __call__(self) -> None:
        self.count += 1
        key = f"barrier/{self.count}"
        if self.store.add(key, 1) == self.nprocs:
            self.store.set(f"{key}/done", "1")
        self.store.wait([f"{key}/done"])

    def leave(self, rank: int) -> None:
        """The store's host (rank 0) returns only after every other rank is done with the store."""
        if rank != 0:
            self.store.add("left", 1)
            return
        while self.store.add("left", 0) < self.nprocs - 1:
            time.sleep(0.01)

    def max(self, key: str, rank: int, value: float) -> float:
        """The largest ``value`` over all ranks (every rank gets the same answer)."""
        self.store.set(f"{key}/{rank}", repr(value))
        self()
        return max(float(self.store.get(f"{key}/{r}").decode()) for r in range(self.nprocs))


@dataclass
class _Ctx:
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

    def refit_address(self, method: str) -> str:
        return f"127.0.0.1:{self.ports[method]}"

    def wire_plan(self) -> WirePlan:
        """What the wire moves: a one-to-one run's model bytes over its pair, else refit's plan (which
        the first refit method published; the runner puts the wire after it)."""
        if self.nprocs == 2:
            return single_pair(0, self.first_gen, self.wire_bytes)
        return WirePlan.from_json(json.loads(self.store.get(WIRE_PLAN_KEY).decode()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _checksum(data: torch.Tensor) -> int:
    """A position-weighted sum of the bytes' 32-bit words, 256 MiB at a time (no big temporaries)."""
    words = data[:data.numel() // 4 * 4].view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for i, chunk in enumerate(words.split(64 << 20)):
        total += chunk.sum(dtype=torch.int64) * (i + 1)
    return int(total.item())


def _worker(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    me = job["ranks"][rank]
    device = torch.device(me["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", job["port"], nprocs, rank == 0,
                          timeout=timedelta(seconds=job["timeout_s"]),
                          wait_for_workers=False, use_libuv=True)
    barrier = _Barrier(store, nprocs)
    config = load_config(job["model"])
    seed = job["seed"]
    is_train = me["side"] == "train"
    start = time.perf_counter()
    model: Any
    if is_train:
        model = MegatronStyleModel(config, tp=me["tp"], rank=me["tp_rank"], device=device)
    else:
        fp8_block = tuple(job["fp8_block"]) if job.get("fp8_block") else None
        model = VllmStyleModel(config, tp=me["tp"], rank=me["tp_rank"], device=device, fp8_block=fp8_block)
    if is_train:
        model.fill(seed)
    else:
        model.poison()
    _sync(device)
    build_s = time.perf_counter() - start
    first_gen = job["num_train"]
    pair = rank in (0, first_gen)  # the two ranks the wire and the baselines run between
    ctx = _Ctx(rank, nprocs, is_train, me["side_rank"], job["num_train"] if is_train else nprocs - first_gen,
               device, model, model.nbytes, job["bucket_bytes"], job["num_buffers"], job["timeout_s"],
               job["ports"], register(PluginManager(load_entry_points=False)), store=store, first_gen=first_gen,
               extra={"timeline": job.get("timeline", False),
                      "devices": {r: spec["device"] for r, spec in enumerate(job["ranks"])}})
    needs_comm = nprocs == 2 and any(_is_baseline(m) for m in job["methods"])
    store.set(f"bytes/{rank}", str(model.nbytes))
    barrier()
    ctx.wire_bytes = min(int(store.get(f"bytes/{r}").decode()) for r in (0, first_gen))
    if needs_comm and pair:
        ctx.comm = open_bench_comm(store, "bench", 2, 0 if is_train else 1, device)
    barrier()
    out: dict[str, Any] = {
        "rank": rank, "side": me["side"], "device": str(device), "tp": me["tp"], "tp_rank": me["tp_rank"],
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "model_bytes": model.nbytes, "build_s": build_s, "methods": {},
    }
    for name in job["methods"]:
        method: Any = method_class(name)(ctx)
        is_wire = name.startswith("wire")
        takes_part = not _is_baseline(name) or pair or is_wire
        barrier()
        cuda = device.type == "cuda"
        if cuda:  # what the method holds outside torch's allocator (NCCL's buffers) is the rest of the change
            _sync(device)
            free_before, reserved_before = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        if takes_part:
            method.setup()
        if name.startswith("refit") and rank == 0 and nprocs > 2 and store.add("wire/planned", 1) == 1:
            store.set(WIRE_PLAN_KEY, json.dumps(schedule_plan(method.schedule, first_gen).to_json()))
        barrier()
        if not is_train:
            model.poison()
        gc.collect()
        _sync(device)
        if cuda:
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, own = [], []
        total = job["warmup"] + job["iters"]
        for i in range(total):
            _sync(device)
            barrier()
            t0 = time.perf_counter()
            if takes_part:
                method.step(i)
            _sync(device)
            elapsed = time.perf_counter() - t0
            own.append(elapsed)
            times.append(barrier.max(f"t/{name}/{i}", rank, elapsed))
            timed = times[job["warmup"]:]
            if len(timed) >= job["min_iters"] and sum(timed) > job["budget_s"]:
                break
        gc.collect()
        _sync(device)
        entry: dict[str, Any] = {"times_s": times, "own_times_s": own, "warmup": job["warmup"],
                                 "info": dict(method.info)}
        if cuda:
            entry["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base
            entry["after_extra_bytes"] = torch.cuda.memory_allocated(device) - base
            taken = free_before - torch.cuda.mem_get_info(device)[0]
            entry["outside_torch_bytes"] = taken - (torch.cuda.memory_reserved(device) - reserved_before)
        if is_wire:
            check = method.verify(_checksum)
            if check is not None and method.lanes:
                entry["check"] = check
        elif takes_part:
            if not is_train:
                bad = model.mismatches(seed)
                entry["check"] = "bitwise ok" if not bad else f"{len(bad)} MISMATCHED: {bad[:3]}"
                if name.startswith("refit") and model.version != total - 1 and not bad:
                    entry["check"] = f"version {model.version} != {total - 1}"
        if name.startswith("refit") and takes_part and rank == 0:
            entry["links"] = _link_bytes(method.schedule, job)
        if name.startswith("refit") and takes_part:
            entry.update(method.recorded())
        if takes_part:
            method.close()
        out["methods"][name] = entry
        barrier()
    if ctx.comm is not None:
        ctx.comm.close()
    barrier()
    barrier.leave(rank)
    return out


def _setup_reads(s: dict[str, Any]) -> str:
    """What setup read from the store: the planner (every rank's metadata) and any other rank (its part)."""
    if s.get("planner_read_bytes") is None:  # this run's ranks did not include the planner's record
        return f"metadata read per rank up to {s['metadata_bytes'] / 1024:.1f} KiB"
    return (f"the planner (train rank 0) planned in {s['planner_plan_s']:.2f} s and read "
            f"{s['planner_read_bytes'] / 1024:.1f} KiB, any other rank read up to "
            f"{s['other_read_bytes'] / 1024:.1f} KiB")


def _link_bytes(schedule: Any, job: dict[str, Any]) -> dict[str, int]:
    ranks = job["ranks"]
    first_gen = job["num_train"]
    links: dict[str, int] = {}
    for msgs in schedule.rounds:
        for m in msgs:
            key = f"{ranks[m.src]['device']}->{ranks[first_gen + m.dst]['device']}"
            links[key] = links.get(key, 0) + m.nbytes
    return links


# -- the parent -------------------------------------------------------------------------------------

def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="refit bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma-separated presets or config.json paths (default {DEFAULT_MODELS}; "
                        f"presets: {', '.join(PRESETS)})")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {', '.join(METHODS)} (default {DEFAULT_METHODS}; "
                        "the baselines need one rank per side); refit@bucket=256M+buffers=2+direct=64M+"
                        "zero_copy=0 is a refit variant")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--train-tp", type=int, default=1)
    p.add_argument("--gen-tp", type=int, default=1)
    p.add_argument("--gen-dp", type=int, default=1, help="gen replicas (each a full --gen-tp group)")
    p.add_argument("--train-gpus", default=None, help="GPU of each train rank, e.g. 0,0 (default: all on 0)")
    p.add_argument("--gen-gpus", default=None, help="GPU of each gen rank, e.g. 1,1 (default: all on the last GPU)")
    p.add_argument("--bucket-mib", type=int, default=None, help="refit bucket (default: refit's, 512 MiB on CUDA)")
    p.add_argument("--buffers", type=int, default=3, help="refit staging buffers in flight")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=15.0, help="stop a method's timed steps after this long")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    p.add_argument("--machine", default=None, help="machine name for the results (e.g. nvidia-h200-x2)")
    p.add_argument("--command", default=None, help="the command line to record (default: this one)")
    p.add_argument("--timeline", metavar="PNG", default=None,
                   help="record the first refit method's last step (pack / transfer / unpack per lane) on every "
                        "rank and draw it into PNG (one file per model: MODEL is added to the name after the first)")
    p.add_argument("--lora", default=None, metavar="r=N[,alpha=A][,targets=q,k,v,o,gate,up,down]",
                   help="instead: a LoRA-trained model refitted three ways (full, adapter, merged) on one train and "
                        "one gen rank, and the CPU time of the merge (refit_core.tools.bench.lora)")
    p.add_argument("--fp8-block", default=None, metavar="BN,BK",
                   help="also run every model into a block-FP8 destination (e.g. 128,128): BF16 refit, FP8 "
                        "refit and refit-quantize-after side by side (refit_core.tools.bench.fp8)")
    return p.parse_args(argv)


def _ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    n_train, n_gen = args.train_tp, args.gen_tp * args.gen_dp
    if args.device == "cpu":
        train_dev = ["cpu"] * n_train
        gen_dev = ["cpu"] * n_gen
    else:
        count = torch.cuda.device_count()
        if count < 1:
            raise SystemExit("refit bench: no CUDA device (use --device cpu for a smoke run)")
        tg = [int(g) for g in args.train_gpus.split(",")] if args.train_gpus else [0] * n_train
        gg = [int(g) for g in args.gen_gpus.split(",")] if args.gen_gpus else [count - 1] * n_gen
        if len(tg) != n_train or len(gg) != n_gen:
            raise SystemExit(f"refit bench: need {n_train} train GPUs and {n_gen} gen GPUs, got {tg} and {gg}")
        train_dev = [f"cuda:{g}" for g in tg]
        gen_dev = [f"cuda:{g}" for g in gg]
    ranks = [{"side": "train", "side_rank": i, "tp": args.train_tp, "tp_rank": i, "device": train_dev[i]}
             for i in range(n_train)]
    ranks += [{"side": "gen", "side_rank": j, "tp": args.gen_tp, "tp_rank": j % args.gen_tp, "device": gen_dev[j]}
              for j in range(n_gen)]
    return ranks


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summarize(model: str, job: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    config = load_config(model)
    n_train = job["num_train"]
    gen = results[n_train:]
    received = sum(r["model_bytes"] for r in gen)
    rows = []
    for name in job["methods"]:
        entries = [r["methods"][name] for r in results]
        e0 = entries[0]
        timed = e0["times_s"][e0["warmup"]:]
        t = _median(timed)
        info = {k: v for e in entries for k, v in e["info"].items()}
        moved = e0["info"].get("wire_bytes", results[0]["model_bytes"]) if _is_baseline(name) else received
        moved = info.get("bytes_moved", moved)
        row = {"method": name, "time_s": t, "times_s": timed, "bytes": moved, "gbps": moved / t / 1e9,
               "checks": sorted({e.get("check") for e in entries if e.get("check")}), "info": info}
        for side, sel in (("sender", results[:n_train]), ("receiver", gen)):
            for key in ("peak_extra_bytes", "after_extra_bytes", "outside_torch_bytes"):  # the side's largest
                values = [r["methods"][name].get(key) for r in sel]
                row[f"{side}_{key}"] = max(values) if None not in values else None
        if "links" in e0:
            row["links"] = e0["links"]
        setups = [e["setup"] for e in entries if e.get("setup")]
        if setups:  # the slowest rank per phase; what the planner (train rank 0) and the others read
            row["setup"] = {k: max((s[k] or 0.0) for s in setups) for k in setups[0] if k != "planner"}
            planner = [s for s in setups if s.get("planner")]
            row["setup"]["planner_plan_s"] = planner[0]["plan_s"] if planner else None
            row["setup"]["planner_read_bytes"] = planner[0]["metadata_bytes"] if planner else None
            row["setup"]["other_read_bytes"] = max((s["metadata_bytes"] for s in setups if not s.get("planner")),
                                                   default=0)
        rows.append(row)
    wire = next((r for r in rows if r["method"] == "wire"), None)
    for row in rows:
        ratio = wire_ratio(row, wire)
        row["ratio_to_wire"] = ratio.value if ratio.valid else None
        row["ratio_to_wire_check"] = ratio.as_json()
        links = row.get("links")
        if links:
            total = sum(links.values())
            remote = [k for k in links if k.split("->")[0] != k.split("->")[1]]
            row["busiest_link_share"] = max(links.values()) / total
            row["links_used"] = len(remote)
    return {
        "model": model, "model_bytes": received, "hf_tensors": len(checkpoint_specs(config, grouped=False)),
        "train": [f"{r['device']} tp{r['tp']}:{r['tp_rank']}" for r in results[:n_train]],
        "gen": [f"{r['device']} tp{r['tp']}:{r['tp_rank']}" for r in gen],
        "device_names": sorted({r["device_name"] for r in results}),
        "build_s": max(r["build_s"] for r in results), "rows": rows,
    }


def wire_ratio(row: dict[str, Any], wire: dict[str, Any] | None) -> Ratio:
    """``row``'s time against the wire's (1.0 = at the wire), a result only if both moved the same bytes
    (the wire over refit's pairs) and ``row`` does not beat the wire (:func:`check_ratio`)."""
    if wire is None:
        return Ratio(None)
    value = wire["time_s"] / row["time_s"] if row["time_s"] else None
    problem = None
    if wire["bytes"] != row["bytes"]:
        problem = f"the wire moved {wire['bytes']:,} bytes, {row['method']} {row['bytes']:,}: not the same bytes"
    elif wire["info"].get("wire_skipped_pairs"):
        problem = f"the wire could not time pairs on one device {wire['info']['wire_skipped_pairs']}"
    return check_ratio(value, "wire moving the same bytes over the same pairs", problem)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _table(summary: dict[str, Any]) -> str:
    head = (f"{summary['model']}: {summary['model_bytes'] / 1e9:.2f} GB, {summary['hf_tensors']} HF tensors; "
            f"train {', '.join(summary['train'])} -> gen {', '.join(summary['gen'])} "
            f"({', '.join(summary['device_names'])})")
    lines = [head, "",
             "| method | time (ms) | GB/s | x wire (same bytes, same pairs) | sender peak extra | "
             "receiver peak extra | extra after (send/recv) | outside torch (send/recv) | check |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in summary["rows"]:
        ratio = Ratio.from_json(r["ratio_to_wire_check"]).text()
        lines.append(f"| {r['method']} | {r['time_s'] * 1e3:.1f} | {r['gbps']:.1f} | {ratio} | "
                     f"{_gib(r['sender_peak_extra_bytes'])} | {_gib(r['receiver_peak_extra_bytes'])} | "
                     f"{_gib(r['sender_after_extra_bytes'])} / {_gib(r['receiver_after_extra_bytes'])} | "
                     f"{_gib(r.get('sender_outside_torch_bytes'))} / {_gib(r.get('receiver_outside_torch_bytes'))} | "
                     f"{'; '.join(r['checks']) or '-'} |")
    for r in summary["rows"]:
        if "busiest_link_share" in r:
            lines.append("")
            lines.append(f"{r['method']}: links {r['links']}; busiest link carries {r['busiest_link_share']:.0%}; "
                         f"{r['links_used']} GPU-to-GPU link(s) used")
    for r in summary["rows"]:
        if "setup" in r:
            s = r["setup"]
            lines.append("")
            lines.append(f"{r['method']} setup (slowest rank per phase): {s['total_s']:.2f} s = pieces "
                         f"{s['pieces_s']:.2f} + metadata {s['metadata_s']:.2f} + plan {s['plan_s']:.2f} + agree "
                         f"{s['agree_s']:.2f} + transport {s['transport_s']:.2f} + bind {s['bind_s']:.2f} s; "
                         + _setup_reads(s))
    infos = [f"{r['method']}: {r['info']}" for r in summary["rows"] if r["info"]]
    if infos:
        lines += ["", *infos]
    return "\n".join(lines)


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "host": platform.node()}
    if args.device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
        try:
            env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    try:
        import nccl.core as nccl
        env["nccl4py"] = nccl.__version__
        env["nccl"] = str(nccl.get_version())
    except Exception as exc:  # noqa: BLE001
        env["nccl4py"] = f"unavailable ({type(exc).__name__}: {exc})"
    env.update(values_of(SAFE_ENV))
    return env


def main(argv: list[str] | None = None) -> int:
    """``refit bench``: returns 0 when every method's result checked out."""
    args = _parse(argv)
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if args.lora:
        return _lora_bench(args)
    ranks = _ranks(args)
    one_to_one = len(ranks) == 2
    methods = (args.methods or (DEFAULT_METHODS if one_to_one else "wire,refit")).split(",")
    unknown = []
    for m in methods:
        try:
            method_class(m)
        except KeyError:
            unknown.append(m)
    if unknown:
        raise SystemExit(f"refit bench: unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if not one_to_one and any(m in ("per-tensor", "packed") for m in methods):
        raise SystemExit("refit bench: the baselines need one train and one gen rank")
    if not one_to_one:
        methods = wire_after_refit(methods)
    given = argv if argv is not None else sys.argv[1:]
    command = args.command or "refit bench " + " ".join(shlex.quote(a) for a in given)
    report: dict[str, Any] = {
        "machine": args.machine, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command, "environment": _environment(args),
        "settings": {"bucket_mib": args.bucket_mib, "buffers": args.buffers, "warmup": args.warmup,
                     "iters": args.iters, "methods": methods, "train_tp": args.train_tp,
                     "gen_tp": args.gen_tp, "gen_dp": args.gen_dp},
        "models": [],
    }
    ok = True
    fp8_block = tuple(int(b) for b in args.fp8_block.split(",")) if args.fp8_block else None
    if fp8_block:
        report["fp8"] = []
    for model in args.models.split(","):
        runs: list[tuple[list[str], tuple[int, ...] | None]] = [(methods, None)]
        if fp8_block:
            runs.append((fp8_methods(methods), fp8_block))
        summaries = []
        for run_methods, block in runs:
            job = {"model": model, "ranks": ranks, "num_train": args.train_tp, "methods": run_methods,
                   "port": free_port(), "ports": {m: free_port() for m in run_methods}, "seed": args.seed,
                   "bucket_bytes": args.bucket_mib * MiB if args.bucket_mib else None, "num_buffers": args.buffers,
                   "warmup": args.warmup, "iters": args.iters, "min_iters": args.min_iters,
                   "budget_s": args.budget_s, "timeout_s": args.timeout_s, "fp8_block": block,
                   "timeline": bool(args.timeline)}
            started = time.perf_counter()
            results = spawn(_worker, len(ranks), job, env=SAFE_ENV, timeout_s=args.timeout_s * 4)
            summary = _summarize(model, job, results)
            summary["fp8_block"] = block
            summary["wall_s"] = time.perf_counter() - started
            summary["ranks"] = results
            summaries.append(summary)
            report["models"].append(summary)
            print(_table(summary), flush=True)
            if job["timeline"]:
                label = model if block is None else f"{model}-fp8"
                path = _timeline_path(args.timeline, label, first=len(summaries) == 1 and not report["models"][:-1])
                print(f"timeline: {_draw_timeline(job, results, path, label)}", flush=True)
            print(flush=True)
            for row in summary["rows"]:
                if any(("ok" not in c) for c in row["checks"]) or (row["method"] != "wire" and not row["checks"]):
                    ok = False
        if fp8_block:
            comparison = fp8_comparison(*summaries)
            report["fp8"].append(comparison)
            print(fp8_table([comparison]), flush=True)
            print(flush=True)
        if args.out:  # after every model, so a later failure keeps what was measured
            _write(report, args.out)
    return 0 if ok else 1


def _lora_bench(args: argparse.Namespace) -> int:
    """``refit bench --lora``: each model's three LoRA refits; 0 when every check passed."""
    from refit_core.contract.lora import LoraSpec
    from refit_core.tools.bench.lora import run

    lora = LoraSpec.parse(args.lora)
    ok = True
    for model in args.models.split(","):
        bench = run(model, lora, device=args.device, warmup=args.warmup, iters=args.iters,
                    bucket_bytes=args.bucket_mib * MiB if args.bucket_mib else None, timeout_s=args.timeout_s)
        print(bench.table(), flush=True)
        ok = ok and all(row["check"] == "bitwise ok" for row in bench.rows.values())
        if args.out:
            with open(f"{args.out}-lora-{model.replace('/', '_')}.md", "w") as f:
                f.write(bench.table() + "\n")
    return 0 if ok else 1


def wire_after_refit(methods: list[str]) -> list[str]:
    """A multi-rank run's methods with every wire after the first refit method, whose schedule is the
    wire's plan (same bytes, same pairs)."""
    wires = [m for m in methods if m.split("@")[0] == "wire"]
    if not wires:
        return methods
    first = next((i for i, m in enumerate(methods) if m.startswith("refit")), None)
    if first is None:
        raise SystemExit("refit bench: the wire of a multi-rank run moves refit's plan: add a refit method")
    rest = [m for m in methods if m not in wires]
    at = rest.index(methods[first]) + 1
    return rest[:at] + wires + rest[at:]


def _timeline_path(path: str, model: str, first: bool) -> str:
    if first:
        return path
    stem, dot, ext = path.rpartition(".")
    name = os.path.basename(model).replace(".json", "")
    return f"{stem}-{name}.{ext}" if dot else f"{path}-{name}"


def _draw_timeline(job: dict[str, Any], results: list[dict[str, Any]], path: str, model: str) -> str:
    """The first refit method's recorded step of every rank, drawn into ``path``."""
    from refit_core.run.timing import StepTimeline
    from refit_core.tools.pictures import write_timeline_picture

    method = next((m for m in job["methods"] if m.startswith("refit")), None)
    ranks = []
    for r in results:
        entry = r["methods"].get(method, {}) if method else {}
        if "timeline" in entry:
            ranks.append((f"{r['side']} {r['rank'] - (job['num_train'] if r['side'] == 'gen' else 0)}",
                          StepTimeline.from_json(entry["timeline"])))
    return write_timeline_picture(ranks, path, f"{model}: {method}, last step, every rank")


def _write(report: dict[str, Any], prefix: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    env = report["environment"]
    md = [f"# refit bench: {report['machine'] or env.get('host')}, {report['date']}", "",
          f"Command: `{report['command']}`", "",
          f"Environment: {json.dumps(env)}", "",
          f"Settings: {json.dumps(report['settings'])}", ""]
    if report.get("fp8"):
        md += ["## FP8 destinations", "", fp8_table(report["fp8"]), ""]
    for summary in report["models"]:
        title = summary["model"] + (f" into block-FP8 {summary['fp8_block']}" if summary.get("fp8_block") else "")
        md += ["## " + title, "", _table(summary), ""]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(md))
