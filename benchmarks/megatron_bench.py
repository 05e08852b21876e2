"""Megatron-core -> vLLM-layout refit, side by side with the wire, in one run (2 processes).

Rank 0 (train, GPU 0) builds a megatron-core ``GPTModel`` of the model's shape (local spec, TP 1,
random weights drawn on the device) and refits it through ``refit-plugin-megatron``; rank 1 (gen,
GPU 1) holds the benchmark's vLLM-style layout (``qkv_proj``, ``gate_up_proj``: ``refit_core.tools.bench``)
and checks every byte after each setting's last step. In the same run both measure the wire: one
contiguous buffer of the same bytes over the same kind of communicator (nccl4py on GPUs). With
``--nccl auto,2/0`` refit runs once per NCCL setting (a setup each; the wire before every step of each):
``auto`` leaves :class:`NcclOptions` to the plan, ``K`` sets ``comms_per_link``, ``K/C`` also ``max_ctas``.
Prints and writes ``{out}.json`` / ``{out}.md``: wire and refit medians, the ratio, and setup time
(pieces, plan + bind).

    python benchmarks/megatron_bench.py --device cuda --model llama-3-8b-shape --out $OUT/megatron-h200x2
    python benchmarks/megatron_bench.py --device cpu --model tiny-llama          # a smoke run here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core import (
    ParallelLayout,
    RefitOptions,
    RefitReceiver,
    RefitSender,
    TensorSpec,
)
from refit_core.contract.nccl_options import NcclOptions
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import PRESETS, checkpoint_specs
from refit_core.tools.bench.layouts import MegatronStyleModel, VllmStyleModel, reference, register
from refit_core.tools.bench.methods import open_bench_comm

SEED = 11


def _device(rank: int, kind: str) -> torch.device:
    if kind != "cuda":
        torch.set_num_threads(1)
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Pair:
    """The two processes' own communicator: a barrier and the wire measurement."""

    def __init__(self, store: dist.Store, rank: int, device: torch.device, nbytes: int) -> None:
        self.rank, self.device = rank, device
        self.comm = open_bench_comm(store, "megatron-bench-wire", 2, rank, device)
        self.token = torch.zeros(1, dtype=torch.uint8, device=device)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def _move(self, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            self.comm.post([(1, tensor)], [], self.stream)
        else:
            self.comm.post([], [(0, tensor)], self.stream)
        _sync(self.device)

    def barrier(self) -> None:
        self._move(self.token)

    def wire(self) -> float:
        self.barrier()
        start = time.perf_counter()
        self._move(self.buffer)
        return time.perf_counter() - start

    def release(self) -> None:
        self.buffer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def _fill(pieces: list[Any], specs: dict[str, TensorSpec], device: torch.device) -> None:
    """Every source piece gets the benchmark's values of its HF tensor (drawn on the device)."""
    by_name: dict[str, list[Any]] = {}
    for piece in pieces:
        by_name.setdefault(piece.spec.name, []).append(piece)
    for name, group in by_name.items():
        full = reference(specs[name], SEED, device)
        for piece in group:
            piece.view.copy_(piece.box.slice_of(full))


def _rank(rank: int, world: int, args: dict[str, Any], ports: list[int]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's notes about Apex / Transformer Engine
    device = _device(rank, args["device"])
    config = dict(PRESETS[args["model"]])
    specs = {s.name: s for s in checkpoint_specs(config, grouped=True)}
    nbytes = sum(s.nbytes for s in specs.values())
    store = dist.TCPStore("127.0.0.1", ports[0], 2, is_master=rank == 0, timeout=timedelta(seconds=300))
    pair = _Pair(store, rank, device, nbytes)
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        from refit_megatron import (
            BuildOptions,
            MegatronSource,
            build_gpt,
            init_parallel,
            live_pieces,
        )

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{ports[1]}", rank=0, world_size=1)
        init_parallel(ParallelLayout())
        start = time.perf_counter()
        chunks = build_gpt(config, ParallelLayout(), BuildOptions(dtype=specs["model.norm.weight"].dtype,
                                                                  device=args["device"], seed=SEED))
        _sync(device)
        out["build_s"] = time.perf_counter() - start
        if args["source"] == "synthetic":  # the same process, the benchmark's Megatron-style model instead
            source = MegatronStyleModel(config, tp=1, rank=0, device=device)
            register()
            start = time.perf_counter()
            pieces = source.pieces
            source.fill(SEED)
        else:
            source = MegatronSource(chunks, config)
            start = time.perf_counter()
            pieces = live_pieces(source)
            _fill(pieces, specs, device)
        out["pieces_s"] = time.perf_counter() - start
        out["pieces"] = len(pieces)
        _sync(device)
    else:
        model = VllmStyleModel(config, tp=1, rank=0, device=device)
        register()
    out["runs"] = []
    for run, nccl in enumerate(args["nccl"]):
        options = RefitOptions(timeout_s=300, nccl=_nccl_options(nccl))
        rendezvous = f"127.0.0.1:{ports[2 + run]}"
        if rank == 0:
            endpoint: Any = RefitSender(source, rendezvous=rendezvous, rank=0, world_size=1, options=options)
        else:
            model.poison()  # every setting must land every byte anew
            endpoint = RefitReceiver(model, rendezvous=rendezvous, rank=0, world_size=1, options=options)
        start = time.perf_counter()
        endpoint.setup()
        setup_s = time.perf_counter() - start  # metadata exchange + plan + bind
        wire, refit = [], []
        for step in range(args["steps"]):
            wire.append(pair.wire())
            pair.barrier()
            start = time.perf_counter()
            if rank == 0:
                endpoint.send(version=step)
            else:
                endpoint.receive()
            _sync(device)
            refit.append(time.perf_counter() - start)
        mismatches = model.mismatches(SEED) if rank == 1 else []
        built = getattr(endpoint.transport, "choice", None)  # the NCCL transport's communicators (gloo: none)
        endpoint.close()
        out["runs"].append({"nccl": nccl, "comms": built and built.comms_per_link, "max_ctas": built and built.max_ctas,
                            "setup_s": setup_s, "wire": wire, "refit": refit,
                            "mismatches": mismatches})
    pair.release()
    out.update(bytes=nbytes, tensors=len(specs))
    return out


def _nccl_options(text: str) -> NcclOptions:
    """``auto``, ``K`` or ``K/C`` (see ``--nccl``)."""
    if text == "auto":
        return NcclOptions()
    comms, _, ctas = text.partition("/")
    return NcclOptions(comms_per_link=int(comms), max_ctas=int(ctas) if ctas else None)


def _report(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    train, gen = results
    skip = 1 if args.steps > 2 else 0  # the first exchange warms up communicators and allocators
    nbytes = train["bytes"]

    def median(key: str, t: dict[str, Any], g: dict[str, Any]) -> float:
        return statistics.median(max(a, b) for a, b in zip(t[key][skip:], g[key][skip:]))

    runs = []
    for t, g in zip(train["runs"], gen["runs"]):
        wire, refit = median("wire", t, g), median("refit", t, g)
        runs.append({"nccl": t["nccl"], "comms_per_link": t["comms"], "max_ctas": t["max_ctas"],
                     "wire_s": wire, "wire_gbps": nbytes / wire / 1e9,
                     "refit_s": refit, "refit_gbps": nbytes / refit / 1e9, "refit_vs_wire": wire / refit,
                     "bitwise_ok": not g["mismatches"], "mismatches": g["mismatches"][:5],
                     "setup_plan_bind_s": t["setup_s"],  # the gen side's first one also waits for the model build
                     "raw": {"wire": [t["wire"], g["wire"]], "refit": [t["refit"], g["refit"]]}})
    return {
        "model": args.model, "source": args.source, "device": args.device, "bytes": nbytes,
        "hf_tensors": train["tensors"],
        "source_pieces": train["pieces"], "steps": args.steps, "runs": runs,
        "bitwise_ok": all(r["bitwise_ok"] for r in runs),
        "build_s": train["build_s"], "setup_pieces_s": train["pieces_s"],
        "environment": {"torch": torch.__version__, "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
                        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"},
    }


def _markdown(r: dict[str, Any]) -> str:
    rows = [(f"| {run['nccl']}: {run['comms_per_link'] or '-'} x {run['max_ctas'] or 'NCCL default'} "
             f"| {r['bytes'] / 1e9:.2f} GB | {r['hf_tensors']} | {r['source_pieces']} | "
             f"{run['wire_s'] * 1e3:.1f} ms, {run['wire_gbps']:.0f} GB/s | {run['refit_s'] * 1e3:.1f} ms, "
             f"{run['refit_gbps']:.0f} GB/s | **{run['refit_vs_wire']:.3f}** | "
             f"{'yes' if run['bitwise_ok'] else 'NO'} | "
             f"{r['setup_pieces_s']:.3f} s | {run['setup_plan_bind_s']:.3f} s |") for run in r["runs"]]
    return "\n".join([
        (f"# megatron-core -> vLLM layout refit ({r['model']}, {r['device']}, {r['environment']['gpu']})"
         + (", source: the benchmark's Megatron-style model in the megatron-core process"
            if r["source"] == "synthetic" else "")),
        "",
        ("| NCCL setting: comms per link x max CTAs | bytes | HF tensors | source pieces | wire | refit "
         "| refit / wire | bitwise | setup: pieces | setup: plan + bind |"),
        "|---:|---:|---:|---:|---:|---:|---:|:-:|---:|---:|",
        *rows,
        "",
        (f"Medians of {r['steps']} steps per row (first dropped when more than 2), same run, same bytes, the wire "
         f"measured before every refit step; model build {r['build_s']:.1f} s (not counted)."),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", default="llama-3-8b-shape", help="a refit_core.kit.models preset (dense)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="", help="write OUT.json and OUT.md")
    parser.add_argument("--timeout-s", type=float, default=400)
    parser.add_argument("--nccl", type=lambda text: text.split(","), default=["auto"],
                        help="NCCL settings, one refit run each: auto (the plan's choice), K (comms_per_link) or "
                             "K/C (and max_ctas; 0: NCCL's default), e.g. auto,2/0")
    parser.add_argument("--source", choices=("megatron", "synthetic"), default="megatron",
                        help="synthetic: rank 0 still builds the megatron-core model and its process groups, "
                             "but refits the benchmark's Megatron-style model (refit bench's source) from them")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("megatron bench: needs 2 GPUs", file=sys.stderr)
        return 2
    results = spawn(_rank, 2, vars(args), [free_port() for _ in range(2 + len(args.nccl))], timeout_s=args.timeout_s)
    report = _report(args, results)
    text = _markdown(report)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as out:
            json.dump(report, out, indent=2)
        with open(args.out + ".md", "w") as out:
            out.write(text)
    return 0 if report["bitwise_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
