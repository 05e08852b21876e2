"""``refit demo`` programs of the dtensor backend: an FSDP2 trainer and a DTensor-sharded policy copy.

Each side spawns its ranks (``ctx.layout``; the backend's registered defaults are ``fsdp=2`` for
train and ``tp=2`` for gen; an empty layout is one rank holding a plain, unsharded model), builds
the tiny model from ``ctx.config`` with random weights and shards it with
:func:`refit_dtensor.parallel.shard_model` on its own process group (gloo on CPU, NCCL on CUDA).
The trainer keeps fp32 master weights and, before every step, loads the reference weights of the
step (``ctx.reference(step)``, following the model's checkpoint inventory) into its shards in place,
then sends them as weight version ``step``. The generation side holds the config's dtype (the sender
casts), receives, and checks every destination view bit for bit against the same reference. Rank 0
of each side reports the build, setup and step phases to ``ctx.progress``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from refit_core import ParallelLayout, RefitOptions, RefitReceiver
from refit_core.apps import (
    DemoContext,
    DemoReport,
    free_port,
    mismatches,
    quantized_reference,
    send_versions,
    spawn,
    train_demo,
)
from refit_core.kit import config_dtype

from .fp8 import to_block_fp8
from .parallel import build_model, init_mesh, shard_model
from .shards import load_hf_weights

DEFAULT_TRAIN_LAYOUT = "fsdp=2"
DEFAULT_GEN_LAYOUT = "tp=2"
FP8_BLOCK = (128, 128)
"""``refit demo --quantize fp8``: the blocks of vLLM's / DeepSeek-V3's block-FP8 checkpoints."""


def _start(rank: int, world: int, port: int, device: str, gpu_offset: int) -> torch.device:
    """Join this side's own process group; pick this rank's device."""
    if device == "cuda":
        index = (gpu_offset + rank) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        target = torch.device("cuda", index)
    else:
        torch.set_num_threads(1)
        target = torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    return target


def _model(ctx: DemoContext, layout: ParallelLayout, dtype: torch.dtype, device: torch.device,
           fp8: bool = False) -> torch.nn.Module:
    model = build_model(ctx.config, dtype=dtype, device=device)
    if fp8:
        to_block_fp8(model, FP8_BLOCK)
    shard_model(model, layout, init_mesh(layout, device.type))
    return model


def _layout_name(layout: ParallelLayout) -> str:
    return f"{layout} ({layout.world_size} ranks)" if layout.world_size > 1 else "one rank"


def _train_rank(rank: int, world: int, ctx: DemoContext, port: int) -> list[float]:
    began = time.perf_counter()
    device = _start(rank, world, port, ctx.device, 0)
    model = _model(ctx, ctx.layout, torch.float32, device)
    if rank == 0:
        ctx.progress.built(f"dtensor trainer, {_layout_name(ctx.layout)}, fp32 master weights",
                           time.perf_counter() - began)
    seconds = send_versions(ctx, model, rank, world, lambda step: load_hf_weights(model, ctx.reference(step)))
    dist.destroy_process_group()
    return seconds


def _gen_rank(rank: int, world: int, ctx: DemoContext, layout: ParallelLayout, port: int,
              gpu_offset: int) -> dict[str, Any]:
    began = time.perf_counter()
    device = _start(rank, world, port, ctx.device, gpu_offset)
    dtype = config_dtype(ctx.config)
    fp8 = ctx.quantize == "fp8"
    model = _model(ctx, layout, dtype, device, fp8)
    if rank == 0:
        held = f"{str(dtype).removeprefix('torch.')}" + (f", block-FP8 {FP8_BLOCK} linear weights" if fp8 else "")
        ctx.progress.built(f"dtensor policy, {_layout_name(layout)}, {held}", time.perf_counter() - began)
    receiver = RefitReceiver(model, rendezvous=ctx.rendezvous, rank=rank, world_size=world,
                             options=RefitOptions(**ctx.options))
    receiver.setup()
    pieces = receiver.plugins.destination_map(model).pieces
    seconds, problems, received = [], [], 0
    for step in range(ctx.steps):
        stats = receiver.receive()
        seconds.append(stats.seconds)
        received = stats.bytes
        if stats.version != step:
            problems.append(f"step {step}: received version {stats.version}")
        reference = ctx.reference(step)
        bad = mismatches(pieces, quantized_reference(reference, pieces) if fp8 else reference)
        problems += [f"step {step}: {name} differs" for name in bad]
        totals = torch.tensor([float(stats.bytes), float(len(bad)), stats.seconds], dtype=torch.float64)
        summed = _all_reduce(totals[:2], dist.ReduceOp.SUM, device)
        slowest = _all_reduce(totals[2:], dist.ReduceOp.MAX, device)
        if rank == 0:
            verdict = ("bitwise equal on every rank" if summed[1] == 0
                       else f"{int(summed[1])} tensors DIFFER")
            ctx.progress.step(step, int(summed[0]), float(slowest[0]), verdict)
    receiver.close()
    dist.destroy_process_group()
    return {"seconds": seconds, "bytes": received, "problems": problems,
            "tensors": len({p.spec.name for p in pieces}),
            "fp8_tensors": len({p.spec.name for p in pieces if p.spec.quant is not None})}


def _all_reduce(values: torch.Tensor, op: Any, device: torch.device) -> torch.Tensor:
    """Reduce a few numbers over this side's ranks (a fresh contiguous tensor on the group's device)."""
    buffer = values.clone().to(device)
    dist.all_reduce(buffer, op=op)
    return buffer.cpu()


def demo_train(ctx: DemoContext) -> DemoReport:
    """The training program: ``ctx.layout`` ranks of FSDP2 / TP / 2-D, sending ``ctx.steps`` versions."""
    return train_demo(ctx, _train_rank, free_port())


def demo_gen(ctx: DemoContext) -> DemoReport:
    """The generation program: receives every version and verifies it bitwise."""
    layout = ctx.layout
    gpu_offset = 0
    if ctx.device == "cuda" and torch.cuda.device_count() > layout.world_size and not ctx.colocated:
        gpu_offset = torch.cuda.device_count() - layout.world_size  # keep off the trainer's first GPUs
    results = spawn(_gen_rank, layout.world_size, ctx, layout, free_port(), gpu_offset)
    problems = [f"gen rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    received = sum(r["bytes"] for r in results)
    checked = ("every destination view equals the reference bit for bit after every step"
               if ctx.quantize != "fp8" else
               f"{results[0]['fp8_tensors']} block-FP8 {FP8_BLOCK} weights checked against the reference "
               "quantizer, every view bit for bit after every step")
    lines = [f"dtensor policy received {ctx.steps} versions, {results[0]['tensors']} checkpoint tensors on "
             "rank 0: " + (checked if not problems else f"{len(problems)} MISMATCHES")]
    lines += problems[:10]
    steps = [max(r["seconds"][i] for r in results) for i in range(ctx.steps)]
    return DemoReport(not problems, lines, bytes_per_step=received, seconds_per_step=steps)
