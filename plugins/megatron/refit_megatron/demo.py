"""``refit demo --train megatron``: a megatron-core trainer over gloo (CPU) or NCCL (GPUs).

Spawns ``ctx.layout`` ranks (default ``tp=2``), builds the config's ``GPTModel`` with random
weights (local spec, fp32 master weights), and before every step loads
``reference_state_dict(config, seed, step)`` into its parameters in place (through the plugin's
own pieces), then sends it as weight version ``step``. The gen side checks what lands.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from refit_core.apps import DemoContext, DemoReport, free_port, reference_state_dict, send_versions, train_demo

from .build import BuildOptions, build_gpt, destroy_parallel, init_parallel
from .source import MegatronSource
from .weights import load_hf_weights

DEFAULT_TRAIN_LAYOUT = "tp=2"


def _train_rank(rank: int, world: int, ctx: DemoContext, port: int) -> list[float]:
    if ctx.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if ctx.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    init_parallel(ctx.layout)
    chunks = build_gpt(ctx.config, ctx.layout, BuildOptions(dtype=torch.float32, device=ctx.device))
    source = MegatronSource(chunks, ctx.config)
    seconds = send_versions(ctx, source, rank, world,
                            lambda step: load_hf_weights(source, reference_state_dict(ctx.config, ctx.seed, step)))
    destroy_parallel()
    dist.destroy_process_group()
    return seconds


def demo_train(ctx: DemoContext) -> DemoReport:
    """The training program: ``ctx.layout`` megatron ranks sending ``ctx.steps`` versions."""
    layout = ctx.layout
    start = time.perf_counter()
    report = train_demo(ctx, _train_rank, free_port())
    report.lines.append(f"megatron-core trainer ({layout}, {layout.world_size} ranks, fp32, local spec): "
                        f"sent {ctx.steps} versions in {time.perf_counter() - start:.1f} s")
    return report
