"""The kit's reference side: a plain, obviously correct partner for the backend under test.

A train backend refits into a :class:`ReferenceEngine`; a gen backend is refitted from a
:class:`ReferenceTrainer`. Both hold the checkpoint as plain tensors split across their ranks
(the trainer by rows, the engine by columns, so every round trip reshards), under backend name
:data:`REFERENCE_BACKEND`, with layout hooks so ``refit plan`` describes them from metadata too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.experts import ExpertNaming, default_expert_name, default_member_name
from refit_core.contract.hookspecs import hookimpl
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import reference_tensor
from refit_core.kit.verify import same_bytes

REFERENCE_BACKEND = "refit-reference"
REFERENCE_PLUGIN = "refit-reference"


DEFAULT_NAMING = ExpertNaming(default_expert_name, default_member_name)
"""The core's default expert naming (``...experts.{e}.rest``), for callers without a plugin manager."""


def per_expert_specs(specs: Sequence[TensorSpec], naming: ExpertNaming = DEFAULT_NAMING) -> list[TensorSpec]:
    """Grouped expert specs (``...experts.w1.weight`` of shape ``[E, ...]``) split into one spec per
    expert, named through ``naming`` (a plugin manager's ``expert_naming()``); other specs unchanged."""
    out = []
    for spec in specs:
        grouped = spec.shape and naming.namer(spec.name) is None and naming.member_name(spec.name, 0) is not None
        if grouped:
            names = naming.members(spec.name, spec.shape[0])
            out += [TensorSpec(name, spec.shape[1:], spec.dtype) for name in names]
        else:
            out.append(spec)
    return out


def reference_weights(specs: Sequence[TensorSpec], seed: int, step: int,
                      naming: ExpertNaming = DEFAULT_NAMING) -> dict[str, torch.Tensor]:
    """The full HF state dict (per-expert names) of training ``step``: identical in every process.

    For ``checkpoint_specs(config)`` this equals ``refit_core.kit.models.reference_state_dict``.
    """
    return dict(naming.ungrouped([(spec.name, reference_tensor(spec, seed, step)) for spec in specs]))


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    cuts = [n * i // parts for i in range(parts + 1)]
    return cuts[index], cuts[index + 1] - cuts[index]


def _box(spec: TensorSpec, dim: int, rank: int, world: int) -> Box | None:
    """Part ``rank`` of ``world`` of ``spec`` cut along ``dim`` (None when that part is empty)."""
    start, size = _split(spec.shape[dim], world, rank)
    if size == 0:
        return None
    offsets = [0] * len(spec.shape)
    sizes = list(spec.shape)
    offsets[dim], sizes[dim] = start, size
    return Box(tuple(offsets), tuple(sizes))


class _ReferenceModel:
    """Plain tensors, one per non-empty box of this rank; ``dim_of_split`` is the dimension ranks cut.

    ``specs`` are per-expert (see :func:`per_expert_specs`), as a checkpoint has them.
    """

    dim_of_split: int

    def __init__(self, specs: Sequence[TensorSpec], rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.specs = list(specs)
        self.boxes = {s.name: box for s in self.specs if (box := self.box_of(s, rank, world)) is not None}
        self.tensors = {s.name: torch.zeros(self.boxes[s.name].sizes, dtype=s.dtype)
                        for s in self.specs if s.name in self.boxes}
        self.version = -1

    @classmethod
    def box_of(cls, spec: TensorSpec, rank: int, world: int) -> Box | None:
        dim = 0 if cls.dim_of_split == 0 else len(spec.shape) - 1
        return _box(spec, dim, rank, world) if spec.shape else Box((), ())

    @classmethod
    def layout_pieces(cls, piece: type, specs: Sequence[TensorSpec], rank: int, world: int) -> list[Any]:
        return [piece(s, box) for s in specs if (box := cls.box_of(s, rank, world)) is not None]


class ReferenceTrainer(_ReferenceModel):
    """Train side: every checkpoint tensor cut by rows across the ranks."""

    dim_of_split = 0

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.tensors.items():
            tensor.copy_(self.boxes[name].slice_of(state[name]))


class ReferenceEngine(_ReferenceModel):
    """Gen side: every checkpoint tensor cut by columns (its last dimension) across the ranks."""

    dim_of_split = -1

    def differences(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Name and box of every tensor whose bytes differ from ``state``'s (see :func:`same_bytes`)."""
        return [f"{name}{self.boxes[name]}" for name, tensor in self.tensors.items()
                if not same_bytes(tensor, self.boxes[name].slice_of(state[name]).to(tensor.dtype))]


class ReferencePlugin:
    """The hooks of the reference side, for one checkpoint's per-expert ``specs`` (register it in code,
    in every process)."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = list(specs)

    @hookimpl
    def refit_register_backends(self, register: Any) -> None:
        register(Backend(REFERENCE_BACKEND, frozenset({TRAIN, GEN}), "the conformance kit's plain reference side"))

    @hookimpl
    def refit_source_pieces(self, model: Any) -> list[SourcePiece] | None:
        if not isinstance(model, ReferenceTrainer):
            return None
        specs = {s.name: s for s in model.specs}
        return [SourcePiece(specs[n], model.boxes[n], t) for n, t in model.tensors.items()]

    @hookimpl
    def refit_destination_map(self, model: Any) -> DestinationMap | None:
        if not isinstance(model, ReferenceEngine):
            return None
        specs = {s.name: s for s in model.specs}
        return DestinationMap([DestinationPiece(specs[n], model.boxes[n], t) for n, t in model.tensors.items()])

    @hookimpl
    def refit_begin_update(self, model: Any) -> bool | None:
        return False if isinstance(model, ReferenceEngine) else None

    @hookimpl
    def refit_finish_update(self, model: Any, version: int) -> bool | None:
        if not isinstance(model, ReferenceEngine):
            return None
        model.version = version
        return True

    @hookimpl
    def refit_source_layout(self, backend: str, config: dict, layout: ParallelLayout,
                            rank: int) -> list[SourcePiece] | None:
        if backend != REFERENCE_BACKEND:
            return None
        return ReferenceTrainer.layout_pieces(SourcePiece, self.specs, rank, layout.world_size)

    @hookimpl
    def refit_destination_layout(self, backend: str, config: dict, layout: ParallelLayout,
                                 rank: int) -> DestinationMap | None:
        if backend != REFERENCE_BACKEND:
            return None
        return DestinationMap(ReferenceEngine.layout_pieces(DestinationPiece, self.specs, rank, layout.world_size))
