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
import os
import sys
import time

import torch

from refit_core.contract.options import StridedCopy
from refit_core.kit.launch import free_port, spawn
from refit_core.tools.bench.colocated_rank import TRAINERS, fit_model, model_entry, needed_bytes, run_process
from refit_core.tools.bench.colocated_report import breakdown_table, summarize, table, write
from refit_core.tools.bench.fit import MEMORY_RESERVE, memory_budget

GiB = 1 << 30
METHODS = ("copy-bound", "ping-pong", "refit")
CONFIRM = "refit:+confirm"
"""``refit`` with the landing vote (``confirm=True``): what the commit point costs (on request)."""
VARIANTS = (*(f"refit:{v.value}" for v in StridedCopy),
            *(f"refit:{v.value}+check-first" for v in (StridedCopy.FOREACH, StridedCopy.TRITON)))
"""``refit`` with each way of moving strided copies, and with the trainer's check before its *ready*
signal instead of overlapping the engine's copies (``--variants``)."""


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
    """The colocated benchmark: 0 when every method's check passed."""
    args = _parse(argv)
    models = [m for m in args.models.split(",") if m]
    for entry in models:
        model_entry(entry)
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
    results = spawn(run_process, 2, job, timeout_s=args.timeout_s * (1 + len(models)) + 60,
                    env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    rows = summarize(results)
    skipped = [m["skipped"] for m in results[1]["models"] if m.get("skipped")]
    report = {"skipped": skipped, "machine": args.machine, "device": device,
              "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "iters": args.iters, "fp8_block": args.fp8_block,
              "seconds": time.perf_counter() - start, "rows": rows}
    text = table(rows) + "".join(f"\n\n{reason}" for reason in skipped)
    phases = breakdown_table(rows)
    if phases:
        text += "\n\nWhere a refit step's time goes (median ms over the timed steps):\n\n" + phases
    print(text, flush=True)
    if args.out:
        write(args.out, report, text, args.bound_gib, with_breakdown=bool(phases))
    ok = all(r["checks"] in (["bitwise ok"], ["-"]) for r in rows)
    return 0 if ok else 1


__all__ = [  # the run's parts live in colocated_rank, colocated_report and fit; these stay importable here
    "CONFIRM", "MEMORY_RESERVE", "METHODS", "TRAINERS", "VARIANTS", "fit_model", "main", "memory_budget",
    "needed_bytes", "summarize", "table",
]


if __name__ == "__main__":
    raise SystemExit(main())
