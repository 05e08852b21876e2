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
from typing import Any

import torch

from refit_core.contract.errors import RefitError
from refit_core.kit.launch import RankFailure, free_port, spawn
from refit_core.kit.models import load_config
from refit_core.tools.bench.peer_ce import CeServer, engine_loader, hf_state
from refit_core.tools.bench.peer_layout import CE, CE_MAX_BUCKET, METHODS, REFIT, Layout, Role, fit_model, needed_bytes
from refit_core.tools.bench.peer_report import all_checked, merge, note, summarize, table
from refit_core.tools.bench.peer_run import PeerWire, run_process

GiB = 1 << 30


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
    """The checkpoint-engine comparison: 0 when every model ran and every check passed."""
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
            merged += merge(spawn(run_process, layout.nprocs, job, timeout_s=args.timeout_s + 90,
                                   env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}))
        except RankFailure as exc:
            failed.append(f"{name} failed: {str(exc)[-3000:]}")
            print(failed[-1], file=sys.stderr, flush=True)
        _report(args, layout, merged, failed, time.perf_counter() - start)
    return 0 if merged and not failed and all_checked(summarize(merged, layout.bound)) else 1


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


__all__ = [  # the run's parts live in peer_layout, peer_ce, peer_run and peer_report; these stay importable here
    "CE", "CE_MAX_BUCKET", "METHODS", "REFIT", "CeServer", "Layout", "PeerWire", "Role", "engine_loader",
    "fit_model", "hf_state", "main", "needed_bytes", "note", "preflight", "summarize", "table",
]


if __name__ == "__main__":
    raise SystemExit(main())
