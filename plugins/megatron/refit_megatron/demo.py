"""``refit demo --train megatron``: a megatron-core trainer over gloo (CPU) or NCCL (GPUs).

Spawns ``ctx.layout`` ranks (default ``tp=2``), builds the config's ``GPTModel`` with random
weights (local spec, fp32 master weights), and before every step loads
``reference_state_dict(config, seed, step)`` into its parameters in place (through the plugin's
own pieces), then sends it as weight version ``step``. The gen side checks what lands.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from refit_core import ParallelLayout, RefitOptions, RefitSender
from refit_core.kit.demo import DemoContext, DemoReport
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import reference_state_dict

from .build import BuildOptions, build_gpt, destroy_parallel, init_parallel
from .source import MegatronSource
from .weights import load_hf_weights

DEFAULT_TRAIN_LAYOUT = "tp=2"


def _train_rank(rank: int, world: int, ctx: DemoContext, layout: ParallelLayout, port: int) -> dict[str, Any]:
    if ctx.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if ctx.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    init_parallel(layout)
    chunks = build_gpt(ctx.config, layout, BuildOptions(dtype=torch.float32, device=ctx.device))
    source = MegatronSource(chunks, ctx.config)
    sender = RefitSender(source, rendezvous=ctx.rendezvous, rank=rank, world_size=world,
                         options=RefitOptions(**ctx.options))
    began = time.perf_counter()
    schedule = sender.setup()
    if rank == 0:
        ctx.progress.planned(schedule, time.perf_counter() - began, sender.setup_times)
    seconds = []
    for step in range(ctx.steps):
        load_hf_weights(source, reference_state_dict(ctx.config, ctx.seed, step))
        seconds.append(sender.send(version=step).seconds)
    sender.close()
    destroy_parallel()
    dist.destroy_process_group()
    return {"seconds": seconds}


def demo_train(ctx: DemoContext) -> DemoReport:
    """The training program: ``ctx.layout`` megatron ranks sending ``ctx.steps`` versions."""
    layout = ctx.layout
    start = time.perf_counter()
    results = spawn(_train_rank, layout.world_size, ctx, layout, free_port())
    steps = [max(r["seconds"][i] for r in results) for i in range(ctx.steps)]
    line = (f"megatron-core trainer ({layout}, {layout.world_size} ranks, fp32, local spec): "
            f"sent {ctx.steps} versions in {time.perf_counter() - start:.1f} s")
    return DemoReport(True, [line],
                      seconds_per_step=steps)
