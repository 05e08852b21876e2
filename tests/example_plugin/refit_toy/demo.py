"""The toy backend's demo programs: each side spawns its ranks and refits ``ctx.steps`` times."""

from __future__ import annotations

import torch

from refit_core import RefitOptions, RefitReceiver
from refit_core.apps import DemoContext, DemoReport, mismatches, reference_tensor, send_versions, spawn, train_demo

from .models import CHECKPOINT, EXPERTS, ODD_GROUPED_EXPERTS, ToyEngine, ToyTrainer, odd_member_name


def reference(seed: int, step: int, odd_experts: bool = False) -> dict[str, torch.Tensor]:
    """The full checkpoint of version ``step`` (experts under the plugin's own naming if ``odd_experts``).

    Both namings hold the same values: expert ``e`` is drawn under its HF name either way.
    """
    if not odd_experts:
        return {spec.name: reference_tensor(spec, seed, step) for spec in CHECKPOINT}
    hf = reference(seed, step)
    odd = {name: tensor for name, tensor in hf.items() if ".experts." not in name}
    for e in range(EXPERTS):
        odd[odd_member_name(ODD_GROUPED_EXPERTS, e)] = hf[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
    return odd


def _train_rank(rank: int, world: int, ctx: DemoContext) -> list[float]:
    trainer = ToyTrainer(rank, world)
    if rank == 0:
        ctx.progress.built(f"toy trainer, {world} ranks", 0.0)
    return send_versions(ctx, trainer, rank, world, lambda step: trainer.load(reference(ctx.seed, step)))


def _gen_rank(rank: int, world: int, ctx: DemoContext) -> tuple[int, list[float]]:
    engine = ToyEngine(rank, world)
    receiver = RefitReceiver(engine, rendezvous=ctx.rendezvous, rank=rank, world_size=world,
                             options=RefitOptions(**ctx.options))
    receiver.setup()
    pieces = receiver.plugins.destination_map(engine).pieces
    seconds = []
    for step in range(ctx.steps):
        stats = receiver.receive()
        bad = mismatches(pieces, reference(ctx.seed, step))
        if bad or engine.version != step:
            raise AssertionError(f"gen rank {rank} step {step}: version {engine.version}, differs: {bad}")
        seconds.append(stats.seconds)
        if rank == 0:
            ctx.progress.step(step, stats.bytes, stats.seconds, "rank 0 bitwise equal")
    receiver.close()
    return stats.bytes, seconds


def run_train(ctx: DemoContext) -> DemoReport:
    return train_demo(ctx, _train_rank)


def run_gen(ctx: DemoContext) -> DemoReport:
    results = spawn(_gen_rank, ctx.layout.world_size, ctx)
    received = sum(b for b, _ in results)
    return DemoReport(True, [f"toy engine: {ctx.layout.world_size} ranks verified {ctx.steps} versions bitwise"],
                      bytes_per_step=received, seconds_per_step=[max(s) for s in zip(*(s for _, s in results))])
