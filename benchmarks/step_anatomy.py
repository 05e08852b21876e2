"""Where the host time of a refit step goes before its first byte moves: ``refit bench`` with host marks.

Runs ``refit bench`` (same arguments) with every rank's refit endpoints and executors wrapped so that each
step records ``time.perf_counter()`` marks (one clock for every process of a host), then prints, per run and
rank, the median of each mark over the timed steps of the first refit method named in ``--methods``, in ms
from the earliest rank's entry into ``send()`` / ``receive()``:

- ``check`` (train) / ``bind`` (gen): the per-step check that the model kept its memory (``.in`` / ``.out``),
- ``run``: the network executor starts; ``headers_posted``, ``headers_checked``: the step header exchange
  (``exchange``: its post to the transport; ``sync``: the wait for it),
- ``first_post``: the first data operation posted (the wire can start once both ends reach it),
- ``last_post``, ``finished``: every operation posted, every operation done; ``exit``: the call returns.

The marks cost about a microsecond each; a step's time in the bench table includes them. GPU runs only
make sense warm (the bench's warm-up steps are skipped here too). ``--megatron`` runs
``benchmarks/megatron_bench.py`` (its arguments) instead: a megatron-core ``GPTModel`` as the source, every
step timed (the first one's marks are skipped)::

    python benchmarks/step_anatomy.py --models llama-3-8b-shape --methods wire,refit \\
        --train-gpus 0 --gen-gpus 1 --iters 10 --out /tmp/anatomy
    python benchmarks/step_anatomy.py --megatron --device cuda --steps 10
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.net.transport import gloo, nccl
from refit_core.run import executor
from refit_core.tools.bench import runner

MARKS = ("enter", "check.in", "check.out", "bind.in", "bind.out", "run", "exchange.in", "exchange.out",
         "headers_posted", "buffers.in", "buffers.out", "sync.in", "sync.out", "headers_checked", "first_post",
         "last_post", "finished", "exit")
MARKS_DIR = "REFIT_ANATOMY_DIR"
"""Where the rank processes write their marks (set by this script for the ranks it starts)."""

_steps: list[dict[str, float]] = []
_current: dict[str, float] = {}


def _mark(name: str) -> None:
    _current.setdefault(name, time.perf_counter())  # a step's first occurrence


def _wrap(owner: type, method: str, before: str | None = None, after: str | None = None,
          when: Callable[[tuple[Any, ...]], bool] | None = None) -> None:
    original = getattr(owner, method)

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        marked = when is None or when(args)
        if marked and before:
            _mark(before)
        result = original(self, *args, **kwargs)
        if marked and after:
            _mark(after)
        return result
    setattr(owner, method, wrapped)


def _wrap_step(owner: type, method: str) -> None:
    original = getattr(owner, method)

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        _current.clear()
        _current["enter"] = time.perf_counter()
        result = original(self, *args, **kwargs)
        _current["exit"] = time.perf_counter()
        _steps.append(dict(_current))
        return result
    setattr(owner, method, wrapped)


def _instrument() -> None:
    _wrap_step(RefitSender, "send")
    _wrap_step(RefitReceiver, "receive")
    _wrap(RefitSender, "_moved_sources", "check.in", "check.out")
    _wrap(RefitReceiver, "_bind_step", "bind.in", "bind.out")
    for side in (executor.SendExecutor, executor.ReceiveExecutor):
        _wrap(side, "run", before="run")
    _wrap(executor.RoundRunner, "_post_headers", after="headers_posted")
    _wrap(executor.RoundRunner, "_exchange", "exchange.in", "exchange.out", when=lambda args: args[3] < 0)
    _wrap(executor.RoundRunner, "_buffers", "buffers.in", "buffers.out")
    _wrap(executor.RoundRunner, "_check_headers", "sync.in", "headers_checked")
    for fence in (gloo._WorkFence, nccl._NcclFence):  # a step's first wait is the header exchange's
        _wrap(fence, "synchronize", after="sync.out")
    _wrap(executor.RoundRunner, "_exchange", before="first_post", when=lambda args: args[3] >= 0)
    _wrap(executor.RoundRunner, "_finish", "last_post", "finished")


def worker(rank: int, nprocs: int, job: dict[str, Any]) -> dict[str, Any]:
    """A bench rank with marks; writes them to ``$REFIT_ANATOMY_DIR/RUN-rankN.json``."""
    _instrument()
    out = _bench_worker(rank, nprocs, job)
    label = f"{job['model']}{'-fp8' if job.get('fp8_block') else ''}"
    Path(os.environ[MARKS_DIR], f"{label}-rank{rank}.json").write_text(json.dumps(_steps))
    return out


_bench_worker = runner._worker


def megatron_rank(rank: int, world: int, args: dict[str, Any], ports: list[int]) -> dict[str, Any]:
    """A megatron bench rank with marks; writes them to ``$REFIT_ANATOMY_DIR/megatron-rankN.json``."""
    import megatron_bench

    _instrument()
    out = megatron_bench._rank(rank, world, args, ports)
    Path(os.environ[MARKS_DIR], f"megatron-rank{rank}.json").write_text(json.dumps(_steps))
    return out


def summary(folder: Path, skip: int, count: int) -> str:
    """Per run and rank, each mark's median over steps ``skip`` to ``count`` (the first refit method's timed
    steps: later refit methods of the run append theirs)."""
    runs: dict[str, dict[int, list[dict[str, float]]]] = {}
    for path in sorted(folder.glob("*-rank*.json")):
        label, rank = path.stem.rsplit("-rank", 1)
        runs.setdefault(label, {})[int(rank)] = json.loads(path.read_text())
    lines = []
    for label, ranks in runs.items():
        steps = min(count, *(len(s) for s in ranks.values()))
        lines.append(f"{label} (ms from the first rank's entry; median of {max(0, steps - skip)} steps)")
        for rank, marks in sorted(ranks.items()):
            times: dict[str, list[float]] = {}
            for i in range(skip, steps):
                origin = min(r[i]["enter"] for r in ranks.values())
                for name in MARKS:
                    if name in marks[i]:
                        times.setdefault(name, []).append((marks[i][name] - origin) * 1e3)
            lines.append(f"  rank {rank}: " + "  ".join(f"{k}={statistics.median(v):.3f}" for k, v in times.items()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="refit-anatomy-") as folder:
        os.environ[MARKS_DIR] = folder
        if argv[:1] == ["--megatron"]:
            import megatron_bench

            megatron_bench._rank = megatron_rank  # its spawn() starts this module's wrapper
            code = megatron_bench.main(argv[1:])
            steps = len(json.loads(next(Path(folder).glob("*-rank0.json")).read_text()))
            print(summary(Path(folder), 1, steps), flush=True)
            return code
        runner._worker = worker  # the ranks import this module (multiprocessing's main) and run it
        code = runner.main(argv)
        args = runner._parse(argv)
        print(summary(Path(folder), args.warmup, args.warmup + args.iters), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
