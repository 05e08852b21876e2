"""What a plugin author hands the conformance kit: model cases, layouts, refusals and rank factories.

Everything here is data plus top-level functions, so a :class:`Conformance` pickles into the
processes of a multi-process round trip. The kit never builds a model itself: the plugin's own
factories do, on each rank, exactly as a trainer or an engine would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core.contract.layout import ParallelLayout
from refit_core.contract.side import Side
from refit_core.contract.spec import TensorSpec
from refit_core.kit.models import PRESETS, checkpoint_specs


@dataclass(frozen=True)
class ModelCase:
    """A model the backend must describe: a HF ``config`` and the checkpoint it stands for.

    ``checkpoint`` is None for the decoder families the core knows from config alone
    (``refit_core.kit.models.checkpoint_specs``); a backend whose models are not HF decoders lists its
    checkpoint tensors here (per-expert or grouped names).
    """

    name: str
    config: Mapping[str, Any]
    checkpoint: tuple[TensorSpec, ...] | None = None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelCase:
        """A ``refit_core.kit.models.PRESETS`` model, optionally with config fields changed."""
        return cls(name, {**PRESETS[name], **overrides})

    def specs(self) -> list[TensorSpec]:
        return list(self.checkpoint) if self.checkpoint is not None else checkpoint_specs(dict(self.config))


@dataclass(frozen=True)
class Refusal:
    """Something the backend cannot serve: its layout hook must raise ``PluginError`` matching ``match``.

    ``model`` None means the suite's first model.
    """

    side: Side
    layout: str
    match: str
    model: ModelCase | None = None


@dataclass(frozen=True)
class RankContext:
    """What a factory gets on each rank of a round trip.

    ``init_method`` is a free ``tcp://`` address for the side's own process group (the trainer's
    or engine's, never refit's); a factory that needs one calls
    ``torch.distributed.init_process_group("gloo", init_method=ctx.init_method, rank=ctx.rank,
    world_size=ctx.world_size)`` and destroys it in its ``close``.
    """

    rank: int
    world_size: int
    layout: ParallelLayout
    config: Mapping[str, Any]
    init_method: str


@dataclass(frozen=True)
class TrainFactory:
    """How to build the backend's training model on one rank and put weights in it.

    - ``build(ctx)``: this rank's sharded model (random weights are fine).
    - ``load(model, state)``: copy a full HF state dict (per-expert names) into the model *in place*
      (refit reads the same views every step).
    - ``close(model)``: release what ``build`` opened (process groups); None: nothing to do.
    """

    build: Callable[[RankContext], Any]
    load: Callable[[Any, dict[str, torch.Tensor]], None]
    close: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class GenFactory:
    """How to build the backend's generation model on one rank and read what landed in it.

    - ``build(ctx)``: this rank's engine model.
    - ``verify(model, state)``: names of what differs from the full HF state dict ``state``, bit for
      bit; None: the kit compares the views of ``refit_destination_map`` (right for any engine whose
      views stay its live memory after ``refit_finish_update``). Either way the check goes through the
      plugin's own idea of where each tensor lives: a destination map that writes the wrong slice
      passes it.
    - ``load(model, state)``: the independent reference: put the full HF state dict ``state`` into a
      model through the engine's own loading path (what the engine does with a checkpoint, e.g.
      vLLM's ``load_weights``), never through ``refit_destination_map``. The kit then builds a second
      model on each gen rank, loads the reference into it with ``load`` and compares the refitted
      model with it bit for bit (``parameters`` if given, else the destination views position by
      position), on top of ``verify``. None: no independent reference (say why in the suite).
    - ``restores_on_abort``: True if ``refit_abort_update`` gives the previous weights back (the kit
      then checks it does, bitwise); False if the backend cannot (the kit checks the hook does not
      fail, and that the next full step is correct).
    - ``parameters(model)``: named tensors every byte of which some destination view must write (the
      kit checks it after ``refit_begin_update``); None: views are only checked for overlap.
    - ``close(model)``: release what ``build`` opened; None: nothing to do.
    """

    build: Callable[[RankContext], Any]
    verify: Callable[[Any, dict[str, torch.Tensor]], list[str]] | None = None
    restores_on_abort: bool = True
    parameters: Callable[[Any], dict[str, torch.Tensor]] | None = None
    close: Callable[[Any], None] | None = None
    load: Callable[[Any, dict[str, torch.Tensor]], None] | None = None


@dataclass(frozen=True)
class RoundTrip:
    """A multi-process refit to run: the backend's ranks in ``layout`` against the kit's reference
    side in ``partner_layout`` (both directions for a backend that serves both sides)."""

    model: ModelCase
    layout: str
    partner_layout: str = "dp=2"


@dataclass(frozen=True)
class Conformance:
    """One backend's conformance suite: the kit runs every check it can from these.

    ``plugin`` is the plugin's registered name (its entry point), ``backend`` the backend it
    registers. ``train_layouts`` / ``gen_layouts`` are checked from metadata alone for every model;
    a backend without a side leaves that side's layouts empty. ``train`` / ``gen`` factories enable
    the live checks and ``round_trips``. ``module`` (``"pkg.mod"`` or ``"pkg.mod:object"``) names a
    plugin to register in code as ``plugin`` when no installed entry point provides it (a plugin not
    packaged yet; tests); None: installed plugins only.
    """

    plugin: str
    backend: str
    models: tuple[ModelCase, ...]
    train_layouts: tuple[str, ...] = ()
    gen_layouts: tuple[str, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    train: TrainFactory | None = None
    gen: GenFactory | None = None
    round_trips: tuple[RoundTrip, ...] = field(default=())
    module: str | None = None

    def layouts(self, side: Side) -> tuple[str, ...]:
        return self.train_layouts if side is Side.TRAIN else self.gen_layouts

    def factory(self, side: Side) -> TrainFactory | GenFactory | None:
        return self.train if side is Side.TRAIN else self.gen
