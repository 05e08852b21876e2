"""Where a refit step's NCCL kernels leave the link idle: ``refit bench`` with torch.profiler on chosen steps.

Runs ``refit bench`` (same arguments) with every rank's ``send()`` / ``receive()`` wrapped: the calls numbered in
``--calls`` (counted per rank process, from 0; each ``--fp8-block`` run and each model is a process of its own)
run under ``torch.profiler`` with CUDA activity and leave a Chrome trace. It then prints, per trace, in ms from
the step's entry: the NCCL kernels' first start, last end, busy time and gaps (the largest, and whether another
kernel ran during each), each NCCL stream's kernels, and the other kernels (a sender's quantizing pack, copies).
The profiler slows the host, so a profiled step is slower than the bench's timed ones; the GPU's kernel times are
its own::

    python benchmarks/kernel_gaps.py --calls 4,5 --models llama-3-8b-shape --methods wire,refit \\
        --train-gpus 0 --gen-gpus 1 --iters 8 --fp8-block 128,128
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.tools.bench import runner

TRACES_DIR = "REFIT_KERNEL_GAPS_DIR"
"""Where the rank processes write their traces (set by this script for the ranks it starts)."""
CALLS = "REFIT_KERNEL_GAPS_CALLS"
"""The calls to profile, comma-separated (set by this script from ``--calls``)."""

Interval = tuple[float, float]


def _profiled(original: Callable[..., Any], label: str) -> Callable[..., Any]:
    calls = {int(c) for c in os.environ[CALLS].split(",")}
    count = 0

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal count
        index, count = count, count + 1
        if index not in calls:
            return original(self, *args, **kwargs)
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as profile:
            with torch.profiler.record_function("refit_step"):
                result = original(self, *args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        profile.export_chrome_trace(str(Path(os.environ[TRACES_DIR], f"{label}-call{index}.json")))
        return result
    return wrapped


def worker(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    """A bench rank whose chosen steps are profiled."""
    label = f"{job['model']}{'-fp8' if job.get('fp8_block') else ''}-rank{rank}"
    RefitSender.send = _profiled(RefitSender.send, label)  # type: ignore[method-assign]
    RefitReceiver.receive = _profiled(RefitReceiver.receive, label)  # type: ignore[method-assign]
    return _bench_worker(rank, nprocs, job)


_bench_worker = runner._worker


def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def summary(path: Path) -> list[str]:
    """The lines printed for one trace (see the module doc)."""
    events = json.loads(path.read_text())["traceEvents"]
    step = next(e for e in events if e.get("name") == "refit_step" and e.get("cat") in ("user_annotation", "cpu_op"))
    origin = step["ts"]
    kernels = [(e["ts"] - origin, e["ts"] + e["dur"] - origin, e["args"].get("stream"), e["name"])
               for e in events if e.get("cat") == "kernel"]
    nccl = [k for k in kernels if "nccl" in k[3].lower()]
    other = [k for k in kernels if "nccl" not in k[3].lower()]
    lines = [f"{path.stem}: host step {_ms(step['dur'])} ms; {len(nccl)} NCCL kernels, {len(other)} others"]
    if not nccl:
        return lines
    busy = _union([(s, e) for s, e, *_ in nccl])
    gaps = sorted(((busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)), reverse=True)
    others = _union([(s, e) for s, e, *_ in other])
    lines.append(f"  NCCL: first start {_ms(busy[0][0])}, last end {_ms(busy[-1][1])}, busy "
                 f"{_ms(sum(e - s for s, e in busy))}, {len(gaps)} gaps of {_ms(sum(g for g, _ in gaps))} in all")
    lines.append("  largest gaps (us @ ms, another kernel running?): " + ", ".join(
        f"{g:.0f}@{_ms(at)} {'yes' if any(s < at + g and e > at for s, e in others) else 'no'}" for g, at in gaps[:8]))
    streams: dict[Any, list[Interval]] = {}
    for start, end, stream, _ in nccl:
        streams.setdefault(stream, []).append((start, end))
    for stream, spans in sorted(streams.items(), key=lambda item: min(item[1])):
        spans.sort()
        lines.append(f"  NCCL stream {stream}: {len(spans)} kernels, {_ms(spans[0][0])}-{_ms(spans[-1][1])}, busy "
                     f"{_ms(sum(e - s for s, e in spans))}")
    if other:
        by_name: dict[str, list[float]] = {}
        for start, end, _, name in other:
            by_name.setdefault(name[:48], []).append(end - start)
        lines.append(f"  other kernels: busy {_ms(sum(e - s for s, e in others))}, {_ms(others[0][0])}-"
                     f"{_ms(others[-1][1])}; " + "; ".join(f"{name} x{len(d)} {_ms(sum(d))}" for name, d in
                                                          sorted(by_name.items(), key=lambda item: -sum(item[1]))[:4]))
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] != ["--calls"] or len(argv) < 2:
        print("usage: kernel_gaps.py --calls N[,N...] REFIT-BENCH-ARGUMENTS", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="refit-kernel-gaps-") as folder:
        os.environ[TRACES_DIR], os.environ[CALLS] = folder, argv[1]
        runner._worker = worker  # the ranks import this module (multiprocessing's main) and run it
        code = runner.main(argv[2:])
        for path in sorted(Path(folder).glob("*.json")):
            print("\n".join(summary(path)), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
