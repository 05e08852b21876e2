"""Plugins that break the contract on purpose: the conformance kit must name each fault.

Registered in code (``Conformance(module=...)``), under their own backend names, beside the
installed plugins. Each builds on the example plugin's toy models.
"""

from __future__ import annotations

from typing import Any

import torch
from refit_toy import plugin as toy
from refit_toy.models import CHECKPOINT, ToyEngine

from refit_core import Backend, DestinationMap, DestinationPiece, ParallelLayout, hookimpl
from refit_core.contract.backend import GEN, TRAIN
from refit_core import Side
from refit_core.testing import Conformance, GenFactory, ModelCase, RankContext, Refusal, RoundTrip

MODEL = ModelCase("toy", {}, checkpoint=tuple(CHECKPOINT))


class Greedy:
    """Claims every model it is asked about, describes a layout that misses the last train rank's
    rows and writes q_proj twice on every gen rank, and refuses with ValueError."""

    @hookimpl
    def refit_register_backends(self, register: Any) -> None:
        register(Backend("greedy", {TRAIN, GEN}))

    @hookimpl
    def refit_destination_map(self, model: Any) -> DestinationMap | None:
        return toy.refit_destination_map(ToyEngine(0, 1, device="meta"))

    @hookimpl
    def refit_source_layout(self, backend: str, config: dict, layout: ParallelLayout, rank: int) -> list | None:
        if backend != "greedy":
            return None
        if layout.tp > 1:
            raise ValueError("tp")
        if rank == layout.world_size - 1 and layout.world_size > 1:
            return []
        return toy.refit_source_layout("toy", config, layout, rank)

    @hookimpl
    def refit_destination_layout(self, backend: str, config: dict, layout: ParallelLayout,
                                 rank: int) -> DestinationMap | None:
        if backend != "greedy":
            return None
        mapping = toy.refit_destination_layout("toy", config, layout, rank)
        q = next(p for p in mapping.pieces if "q_proj" in p.spec.name)
        return DestinationMap([*mapping.pieces, DestinationPiece(q.spec, q.box)])


GREEDY = Conformance(plugin="greedy", backend="greedy", models=(MODEL,), train_layouts=("dp=2",),
                     gen_layouts=("dp=2",), refusals=(Refusal(Side.TRAIN, "tp=2", "tp"),),
                     module="broken_plugins:GREEDY_PLUGIN")
GREEDY_PLUGIN = Greedy()


class SloppyEngine:
    """A toy engine whose plugin lists its pieces in another order than its metadata layout, and
    says it restored the previous weights on abort without doing so."""

    def __init__(self, rank: int, world: int) -> None:
        self.toy = ToyEngine(rank, world)


def build_sloppy(ctx: RankContext) -> SloppyEngine:
    return SloppyEngine(ctx.rank, ctx.world_size)


class Sloppy:
    @hookimpl
    def refit_register_backends(self, register: Any) -> None:
        register(Backend("sloppy", {GEN}))

    @hookimpl
    def refit_destination_map(self, model: Any) -> DestinationMap | None:
        if not isinstance(model, SloppyEngine):
            return None
        return DestinationMap(toy.refit_destination_map(model.toy).pieces[::-1])

    @hookimpl
    def refit_begin_update(self, model: Any) -> bool | None:
        return False if isinstance(model, SloppyEngine) else None

    @hookimpl
    def refit_finish_update(self, model: Any, version: int) -> bool | None:
        return True if isinstance(model, SloppyEngine) else None

    @hookimpl
    def refit_abort_update(self, model: Any, torn: list[str]) -> bool | None:
        return True if isinstance(model, SloppyEngine) else None

    @hookimpl
    def refit_destination_layout(self, backend: str, config: dict, layout: ParallelLayout,
                                 rank: int) -> DestinationMap | None:
        return toy.refit_destination_layout("toy", config, layout, rank) if backend == "sloppy" else None


SLOPPY_PLUGIN = Sloppy()
SLOPPY = Conformance(plugin="sloppy", backend="sloppy", models=(MODEL,), gen_layouts=("dp=2",),
                     gen=GenFactory(build_sloppy, restores_on_abort=True),
                     round_trips=(RoundTrip(MODEL, "dp=2", partner_layout="dp=2"),),
                     module="broken_plugins:SLOPPY_PLUGIN")


class SwappedEngine:
    """A toy engine whose plugin's destination map points ``k_proj`` at the rows that hold ``v_proj``
    and back (boxes, names and metadata all as the toy's): every check that goes through the map
    passes; only the engine's own loader, as an independent reference, sees the wrong slices."""

    def __init__(self, rank: int, world: int) -> None:
        self.toy = ToyEngine(rank, world)


def build_swapped(ctx: RankContext) -> SwappedEngine:
    return SwappedEngine(ctx.rank, ctx.world_size)


def load_swapped(model: SwappedEngine, state: dict[str, torch.Tensor]) -> None:
    model.toy.load_checkpoint(state)


def swapped_parameters(model: SwappedEngine) -> dict[str, torch.Tensor]:
    return {"embed": model.toy.embed, "qkv": model.toy.qkv, "experts_up": model.toy.experts_up, "norm": model.toy.norm}


class Swapped:
    @hookimpl
    def refit_register_backends(self, register: Any) -> None:
        register(Backend("swapped", {GEN}))

    @hookimpl
    def refit_destination_map(self, model: Any) -> DestinationMap | None:
        if not isinstance(model, SwappedEngine):
            return None
        pieces = list(toy.refit_destination_map(model.toy).pieces)
        k = next(i for i, p in enumerate(pieces) if "k_proj" in p.spec.name)
        v = next(i for i, p in enumerate(pieces) if "v_proj" in p.spec.name)
        pieces[k], pieces[v] = (DestinationPiece(pieces[k].spec, pieces[k].box, pieces[v].view),
                                DestinationPiece(pieces[v].spec, pieces[v].box, pieces[k].view))
        return DestinationMap(pieces)

    @hookimpl
    def refit_begin_update(self, model: Any) -> bool | None:
        return False if isinstance(model, SwappedEngine) else None

    @hookimpl
    def refit_finish_update(self, model: Any, version: int) -> bool | None:
        return True if isinstance(model, SwappedEngine) else None

    @hookimpl
    def refit_destination_layout(self, backend: str, config: dict, layout: ParallelLayout,
                                 rank: int) -> DestinationMap | None:
        return toy.refit_destination_layout("toy", config, layout, rank) if backend == "swapped" else None


SWAPPED_PLUGIN = Swapped()
SWAPPED = Conformance(plugin="swapped", backend="swapped", models=(MODEL,), gen_layouts=("dp=2",),
                      gen=GenFactory(build_swapped, restores_on_abort=False, parameters=swapped_parameters,
                                     load=load_swapped),
                      round_trips=(RoundTrip(MODEL, "dp=2", partner_layout=""),),
                      module="broken_plugins:SWAPPED_PLUGIN")
