"""The toy backend's conformance suite (entry point ``refit.conformance: toy``).

What refit's conformance kit needs to check this plugin: the checkpoint its models stand for,
layouts to describe from metadata, a layout it must refuse, and factories that build each side's
model on a rank. ``tests/example_plugin/test_toy_conformance.py`` runs all of it;
``refit check-plugin toy`` the model-free part.
"""

from __future__ import annotations

import torch

from refit_core.testing import Conformance, GenFactory, ModelCase, RankContext, Refusal, RoundTrip, Side, TrainFactory

from .models import CHECKPOINT, ToyEngine, ToyTrainer

MODEL = ModelCase("toy", {}, checkpoint=tuple(CHECKPOINT))


def build_trainer(ctx: RankContext) -> ToyTrainer:
    return ToyTrainer(ctx.rank, ctx.world_size)


def load_trainer(model: ToyTrainer, state: dict[str, torch.Tensor]) -> None:
    model.load(state)


def build_engine(ctx: RankContext) -> ToyEngine:
    return ToyEngine(ctx.rank, ctx.world_size)


def engine_parameters(model: ToyEngine) -> dict[str, torch.Tensor]:
    return {"embed": model.embed, "qkv": model.qkv, "experts_up": model.experts_up, "norm": model.norm}


SUITE = Conformance(
    plugin="toy",
    backend="toy",
    models=(MODEL,),
    train_layouts=("", "dp=2", "fsdp=3"),
    gen_layouts=("", "dp=3"),
    refusals=(Refusal(Side.TRAIN, "tp=2", "dp / fsdp ranks only"), Refusal(Side.GEN, "pp=2", "dp / fsdp ranks only")),
    train=TrainFactory(build_trainer, load_trainer),
    gen=GenFactory(build_engine, restores_on_abort=False, parameters=engine_parameters),
    round_trips=(RoundTrip(MODEL, "dp=2", partner_layout="dp=3"),),
)
