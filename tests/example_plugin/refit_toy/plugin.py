"""The toy backend's hooks: how each toy model's memory maps to HF checkpoint tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refit_core import (
    Backend,
    Box,
    DestinationMap,
    DestinationPiece,
    ExpertName,
    ParallelLayout,
    PluginError,
    Side,
    SourcePiece,
    TensorSpec,
    hookimpl,
)
from refit_core.apps import DemoPrograms

from .models import (
    EXPERTS,
    GROUPED_EXPERTS,
    HEADS_DIM,
    HIDDEN,
    KV_DIM,
    ODD_GROUPED_EXPERTS,
    ToyEngine,
    ToyTrainer,
    checkpoint,
    odd_expert_name,
    odd_member_name,
)


@hookimpl
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend("toy", {Side.TRAIN, Side.GEN}, "example third-party plugin (toy sharded models)"))


@hookimpl
def refit_register_demos(register: Callable[[DemoPrograms], None]) -> None:
    from .demo import run_gen, run_train

    register(DemoPrograms("toy", train=run_train, gen=run_gen, train_layout="dp=2", gen_layout="dp=3", priority=-100))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    if not isinstance(model, ToyTrainer):
        return None
    specs = {s.name: s for s in model.specs}
    return [SourcePiece(specs[name], Box(offsets, tuple(view.shape)), view)
            for name, (offsets, view) in model.shards.items()]


@hookimpl
def refit_destination_map(model: Any) -> DestinationMap | None:
    if not isinstance(model, ToyEngine):
        return None
    spec = {s.name: s for s in checkpoint(model.odd_experts)}
    embed = spec["model.embed_tokens.weight"]
    embed = TensorSpec(embed.name, embed.shape, torch.bfloat16)
    pieces = [DestinationPiece(embed, Box((0, model.col_start), tuple(model.embed.shape)), model.embed)]
    row = 0
    for proj, rows in (("q_proj", HEADS_DIM), ("k_proj", KV_DIM), ("v_proj", KV_DIM)):
        pieces.append(DestinationPiece(spec[f"model.layers.0.self_attn.{proj}.weight"], Box((0, 0), (rows, HIDDEN)),
                                       model.qkv[row:row + rows]))
        row += rows
    pieces.append(DestinationPiece(spec["model.norm.weight"], Box((0,), (HIDDEN,)), model.norm))
    if model.odd_experts:  # the whole grouped tensor through the engine's own loader
        up = spec[odd_member_name(ODD_GROUPED_EXPERTS, 0)]
        return DestinationMap(pieces, loader=[TensorSpec(ODD_GROUPED_EXPERTS, (EXPERTS, *up.shape), up.dtype)])
    up = spec["model.layers.0.mlp.experts.0.up_proj.weight"]
    grouped = TensorSpec(GROUPED_EXPERTS, (EXPERTS, *up.shape), up.dtype)
    pieces.insert(-1, DestinationPiece(grouped, Box((model.expert_start, 0, 0), tuple(model.experts_up.shape)),
                                       model.experts_up))
    return DestinationMap(pieces)


@hookimpl
def refit_expert_name(hf_name: str) -> ExpertName | None:
    return odd_expert_name(hf_name)


@hookimpl
def refit_expert_member_name(group: str, index: int) -> str | None:
    return odd_member_name(group, index)


@hookimpl
def refit_load_weights(model: Any, weights: list[tuple[str, torch.Tensor]]) -> bool | None:
    if not isinstance(model, ToyEngine):
        return None
    model.load_weights(weights)
    return True


@hookimpl
def refit_model_tensors(model: Any) -> list[tuple[str, torch.Tensor]] | None:
    """The trainer's shards by HF name; the engine's tensors by the HF name they hold (fused qkv by its own)."""
    if isinstance(model, ToyTrainer):
        return [(name, view) for name, (_, view) in model.shards.items()]
    if isinstance(model, ToyEngine):
        return [("model.embed_tokens.weight", model.embed), ("qkv", model.qkv),
                ("experts_up", model.experts_up), ("model.norm.weight", model.norm)]
    return None


@hookimpl
def refit_begin_update(model: Any) -> bool | None:
    return False if isinstance(model, ToyEngine) else None


@hookimpl
def refit_finish_update(model: Any, version: int) -> bool | None:
    if not isinstance(model, ToyEngine):
        return None
    model.version = version
    model.torn.clear()
    return True


@hookimpl
def refit_abort_update(model: Any, torn: list[str]) -> bool | None:
    """The toy keeps no copy to restore from: it refuses to serve torn tensors until a refit succeeds."""
    if not isinstance(model, ToyEngine):
        return None
    model.torn.update(torn)
    return True


# Metadata alone (``refit plan``): the same models built on the meta device allocate nothing; the
# pieces keep their specs and boxes and drop their views.

def _world(layout: ParallelLayout) -> int:
    """The toy shards plainly over all its ranks: a layout with other kinds of parallelism is refused."""
    other = {k: v for k, v in layout.given().items() if k not in ("dp", "fsdp")}
    if other:
        raise PluginError(f"the toy backend shards over dp / fsdp ranks only; got {other}")
    return layout.world_size


def _odd(config: dict) -> bool:
    """A toy config ``{"odd_experts": true}`` names experts with the plugin's own scheme."""
    return bool(config.get("odd_experts", False))


@hookimpl
def refit_source_layout(backend: str, config: dict, layout: ParallelLayout, rank: int) -> list[SourcePiece] | None:
    if backend != "toy":
        return None
    pieces = refit_source_pieces(ToyTrainer(rank, _world(layout), device="meta", odd_experts=_odd(config)))
    return [SourcePiece(p.spec, p.box) for p in pieces]


@hookimpl
def refit_destination_layout(backend: str, config: dict, layout: ParallelLayout, rank: int) -> DestinationMap | None:
    if backend != "toy":
        return None
    mapping = refit_destination_map(ToyEngine(rank, _world(layout), device="meta", odd_experts=_odd(config)))
    return DestinationMap([DestinationPiece(p.spec, p.box) for p in mapping.pieces], mapping.loader)
