"""The dtensor backend's conformance suite (entry point ``refit.conformance: dtensor``).

Factories build the standard FSDP2 / TP / 2-D layouts of :mod:`refit_dtensor.parallel` on each rank,
in the rank's own gloo process group, as a trainer (or a DTensor engine) would.
``refit check-plugin dtensor`` runs the model-free part; refit's tests run all of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from refit_core import Side
from refit_core.testing import Conformance, GenFactory, ModelCase, RankContext, Refusal, RoundTrip, TrainFactory

from .names import named_parameters
from .parallel import build_model, init_mesh, shard_model
from .shards import load_hf_weights

MODELS = tuple(ModelCase.preset(name) for name in ("tiny-llama", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral"))
LAYOUTS = ("", "fsdp=2", "tp=2", "fsdp=2,tp=2", "dp=2,fsdp=2")


def build(ctx: RankContext) -> torch.nn.Module:
    """This rank's model in the standard layout ``ctx.layout``, in a process group of its own."""
    dist.init_process_group("gloo", init_method=ctx.init_method, rank=ctx.rank, world_size=ctx.world_size)
    model = build_model(dict(ctx.config), seed=100 + ctx.rank)
    return shard_model(model, ctx.layout, init_mesh(ctx.layout))


def close(model: Any) -> None:
    dist.destroy_process_group()


def local_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's local shard: refit must write all of it."""
    from torch.distributed.tensor import DTensor

    return {name: p.to_local() if isinstance(p, DTensor) else p for name, p in named_parameters(model)}


SUITE = Conformance(
    plugin="dtensor",
    backend="dtensor",
    models=MODELS,
    train_layouts=LAYOUTS,
    gen_layouts=LAYOUTS,
    refusals=(Refusal(Side.TRAIN, "pp=2", "fsdp, tp and dp only"), Refusal(Side.GEN, "ep=2", "fsdp, tp and dp only")),
    train=TrainFactory(build, load_hf_weights, close),
    gen=GenFactory(build, restores_on_abort=False, parameters=local_parameters, close=close),
    round_trips=(RoundTrip(ModelCase.preset("tiny-qwen3-moe"), "tp=2"),),
)
