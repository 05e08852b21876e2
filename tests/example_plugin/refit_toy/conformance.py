"""The toy backend's conformance suite (entry point ``refit.conformance: toy``).

What refit's conformance kit needs to check this plugin: the checkpoint its models stand for,
layouts to describe from metadata, a layout it must refuse, and factories that build each side's
model on a rank. ``tests/example_plugin/test_toy_conformance.py`` runs all of it;
``refit check-plugin toy`` the model-free part.
"""

from __future__ import annotations

import torch

from refit_core import Side
from refit_core.apps import mismatches, same_bytes
from refit_core.testing import Conformance, GenFactory, ModelCase, RankContext, Refusal, RoundTrip, TrainFactory

from .models import CHECKPOINT, ODD_CHECKPOINT, ODD_GROUPED_EXPERTS, ToyEngine, ToyTrainer, odd_member_name
from .plugin import refit_destination_map

MODEL = ModelCase("toy", {}, checkpoint=tuple(CHECKPOINT))
ODD_MODEL = ModelCase("toy-odd-experts", {"odd_experts": True}, checkpoint=tuple(ODD_CHECKPOINT))
"""Experts under the plugin's own naming, through the engine's loader (``refit_load_weights``)."""


def build_trainer(ctx: RankContext) -> ToyTrainer:
    return ToyTrainer(ctx.rank, ctx.world_size, odd_experts=bool(ctx.config.get("odd_experts")))


def load_trainer(model: ToyTrainer, state: dict[str, torch.Tensor]) -> None:
    model.load(state)


def build_engine(ctx: RankContext) -> ToyEngine:
    return ToyEngine(ctx.rank, ctx.world_size, odd_experts=bool(ctx.config.get("odd_experts")))


def verify_engine(model: ToyEngine, state: dict[str, torch.Tensor]) -> list[str]:
    """Fast-path views bit for bit, and the experts the loader path copied (odd naming)."""
    bad = mismatches(refit_destination_map(model).pieces, state)
    if model.odd_experts:
        bad += [f"experts_up[{i}]" for i, expert in enumerate(model.experts_up)
                if not same_bytes(expert, state[odd_member_name(ODD_GROUPED_EXPERTS, model.expert_start + i)])]
    return bad


def load_engine(model: ToyEngine, state: dict[str, torch.Tensor]) -> None:
    """The kit's independent reference: the engine's own checkpoint loader, not the destination map."""
    model.load_checkpoint(state)


def engine_parameters(model: ToyEngine) -> dict[str, torch.Tensor]:
    """What the fast path writes (with odd naming the experts come through the loader instead)."""
    written = {"embed": model.embed, "qkv": model.qkv, "norm": model.norm}
    return written if model.odd_experts else {**written, "experts_up": model.experts_up}


SUITE = Conformance(
    plugin="toy",
    backend="toy",
    models=(MODEL, ODD_MODEL),
    train_layouts=("", "dp=2", "fsdp=3"),
    gen_layouts=("", "dp=3"),
    refusals=(Refusal(Side.TRAIN, "tp=2", "dp / fsdp ranks only"), Refusal(Side.GEN, "pp=2", "dp / fsdp ranks only")),
    train=TrainFactory(build_trainer, load_trainer),
    gen=GenFactory(build_engine, verify_engine, restores_on_abort=False, parameters=engine_parameters,
                   load=load_engine),
    round_trips=(RoundTrip(MODEL, "dp=2", partner_layout="dp=3"), RoundTrip(ODD_MODEL, "dp=3", partner_layout="dp=2")),
)
