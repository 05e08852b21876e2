"""``refit bench``: wire vs. baselines vs. refit, same model, same bytes, one run, checked bitwise.

The command line and the parent process: one process per rank (train ranks first, then gen ranks), each
building its side of the model on its own GPU with random weights (:mod:`~refit_core.tools.bench.rank`);
a method's time is the median over its timed steps of the slowest rank's step
(:mod:`~refit_core.tools.bench.results`); the files a run writes are :mod:`~refit_core.tools.bench.report`'s.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch

from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import PRESETS
from refit_core.tools.bench.broadcast import with_broadcast
from refit_core.tools.bench.fp8 import fp8_comparison, fp8_methods, fp8_table
from refit_core.tools.bench.methods import BASELINES, METHODS, method_class
from refit_core.tools.bench.rank import SAFE_ENV, WIRE_PLAN_KEY
from refit_core.tools.bench.rank import run_rank as _worker  # spawned by name: step_anatomy.py replaces it
from refit_core.tools.bench.report import draw_timeline, environment, timeline_path, write
from refit_core.tools.bench.results import summarize, table, wire_ratio
from refit_core.units import MiB

GiB = 1 << 30
DEFAULT_MODELS = "llama-3-8b-shape,qwen3-30b-a3b-shape"
DEFAULT_METHODS = "wire,per-tensor,packed,refit"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="refit bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma-separated presets or config.json paths (default {DEFAULT_MODELS}; "
                        f"presets: {', '.join(PRESETS)})")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {', '.join(METHODS)} (default {DEFAULT_METHODS}; "
                        "the baselines need one rank per side; broadcast, the reference of a fleet, runs by "
                        "itself with --gen-dp > 1 from one train rank); refit@bucket=256M+buffers=2+direct=64M+"
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
    """Every rank's side, TP rank and device: the train ranks, then the gen ranks."""
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


def main(argv: list[str] | None = None) -> int:
    """``refit bench``: returns 0 when every method's result checked out."""
    args = _parse(argv)
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if args.lora:
        return _lora_bench(args)
    ranks = _ranks(args)
    methods, broadcast_note = with_broadcast(_methods(args, one_to_one=len(ranks) == 2), ranks, args.train_tp)
    given = argv if argv is not None else sys.argv[1:]
    command = args.command or "refit bench " + " ".join(shlex.quote(a) for a in given)
    report: dict[str, Any] = {
        "machine": args.machine, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command, "environment": environment(args),
        "settings": {"bucket_mib": args.bucket_mib, "buffers": args.buffers, "warmup": args.warmup,
                     "iters": args.iters, "methods": methods, "train_tp": args.train_tp,
                     "gen_tp": args.gen_tp, "gen_dp": args.gen_dp},
        "models": [],
    }
    if broadcast_note:
        report["settings"]["broadcast"] = f"not run: {broadcast_note}"
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
            summary, passed = _run(args, model, ranks, run_methods, block, report, broadcast_note)
            summaries.append(summary)
            ok = ok and passed
        if fp8_block:
            comparison = fp8_comparison(*summaries)
            report["fp8"].append(comparison)
            print(fp8_table([comparison]), flush=True)
            print(flush=True)
        if args.out:  # after every model, so a later failure keeps what was measured
            write(report, args.out)
    return 0 if ok else 1


def _methods(args: argparse.Namespace, one_to_one: bool) -> list[str]:
    """The methods to run, checked by name, in the order they run (a multi-rank run's wire after refit)."""
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
    return methods if one_to_one else wire_after_refit(methods)


def _run(args: argparse.Namespace, model: str, ranks: list[dict[str, Any]], methods: list[str],
         block: tuple[int, ...] | None, report: dict[str, Any],
         broadcast_note: str | None = None) -> tuple[dict[str, Any], bool]:
    """One spawn of every rank for ``model`` (``block``: into block-FP8): its summary, printed and added
    to ``report``, and True when every method's result checked out (``broadcast_note``: why the broadcast,
    the reference of a fleet, did not run)."""
    job = {"model": model, "ranks": ranks, "num_train": args.train_tp, "methods": methods,
           "port": free_port(), "ports": {m: free_port() for m in methods}, "seed": args.seed,
           "bucket_bytes": args.bucket_mib * MiB if args.bucket_mib else None, "num_buffers": args.buffers,
           "warmup": args.warmup, "iters": args.iters, "min_iters": args.min_iters,
           "budget_s": args.budget_s, "timeout_s": args.timeout_s, "fp8_block": block,
           "timeline": bool(args.timeline), "broadcast_note": broadcast_note}
    started = time.perf_counter()  # _worker: this module's, which benchmarks/kernel_gaps.py may have replaced
    results = spawn(_worker, len(ranks), job, env=SAFE_ENV, timeout_s=args.timeout_s * 4)
    summary = summarize(model, job, results)
    summary["fp8_block"] = block
    summary["wall_s"] = time.perf_counter() - started
    summary["ranks"] = results
    report["models"].append(summary)
    print(table(summary), flush=True)
    if job["timeline"]:
        label = model if block is None else f"{model}-fp8"
        path = timeline_path(args.timeline, label, first=len(report["models"]) == 1)
        print(f"timeline: {draw_timeline(job, results, path, label)}", flush=True)
    print(flush=True)
    passed = not any(any(("ok" not in c) for c in row["checks"]) or (row["method"] != "wire" and not row["checks"])
                     for row in summary["rows"])
    return summary, passed


def _lora_bench(args: argparse.Namespace) -> int:
    """``refit bench --lora``: each model's three LoRA refits; 0 when every check passed."""
    from refit_core.contract.lora import LoraSpec
    from refit_core.tools.bench.lora import METHODS as LORA_METHODS
    from refit_core.tools.bench.lora import run

    lora = LoraSpec.parse(args.lora)
    ok = True
    for model in args.models.split(","):
        bench = run(model, lora, device=args.device, warmup=args.warmup, iters=args.iters,
                    bucket_bytes=args.bucket_mib * MiB if args.bucket_mib else None, timeout_s=args.timeout_s,
                    methods=tuple(args.methods.split(",")) if args.methods else LORA_METHODS)
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


__all__ = ["BASELINES", "DEFAULT_METHODS", "DEFAULT_MODELS", "SAFE_ENV", "WIRE_PLAN_KEY", "main", "wire_after_refit",
           "wire_ratio"]
