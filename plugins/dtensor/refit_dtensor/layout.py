"""Metadata-only pieces of a ``dtensor:fsdp=F,tp=T,dp=D`` layout (``refit plan``): nothing allocated.

The model is instantiated on the meta device (no memory, ~0.1 s even for a 30B-parameter shape)
so parameter names, shapes and fusions are exactly the live model's; the standard placements of
``parallel.py`` are predicted per parameter and turned into boxes by the same code as the live
path (``placements.local_blocks``, ``shards.placements_of``). The result is checked against the
core's ``checkpoint_specs(config)`` where the core knows the architecture. Rank order: see
:mod:`refit_dtensor.parallel` (mesh ``(dp, fsdp, tp)``, tp fastest).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from refit_core import Box, ParallelLayout, PluginError, RefitError, TensorSpec
from refit_core.kit import checkpoint_specs, config_dtype

from .names import Naming, Target, named_parameters, unwrap
from .parallel import check_layout, is_tied, rank_coordinate, tp_shard_dim, tp_style
from .placements import local_blocks
from .shards import P, placements_of


def predicted_placements(layout: ParallelLayout, tp_dim: int | None) -> tuple[list[str], list[Placement]]:
    """Mesh dimensions (of ``dp, fsdp, tp``) and placements of a parameter in the standard layout."""
    dims: list[str] = []
    placements: list[Placement] = []
    if layout.dp * layout.fsdp > 1:
        if layout.dp > 1:
            dims.append("dp")
            placements.append(Replicate())
        dims.append("fsdp")
        strided = layout.tp > 1 and tp_dim == 0
        placements.append(_StridedShard(0, split_factor=layout.tp) if strided else Shard(0))
    if layout.tp > 1 and tp_dim is not None:
        dims.append("tp")
        placements.append(Shard(tp_dim))
    return dims, placements


@dataclass(frozen=True)
class _Param:
    """A parameter of the model as the metadata path needs it: shape, TP dimension, checkpoint targets."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    targets: tuple[Target, ...]

    @property
    def signature(self) -> tuple:
        """What decides the boxes of this parameter's pieces (everything but names): layers repeat it."""
        return (self.shape, self.tp_dim, tuple((t.shape, t.region, t.perm) for t in self.targets))


@dataclass(frozen=True)
class _Inventory:
    """A config's parameters and one spec per checkpoint target (``specs[i][j]``: param i, target j)."""

    params: tuple[_Param, ...]
    specs: tuple[tuple[TensorSpec, ...], ...]
    kinds: tuple[int, ...]
    """``kinds[i]``: the index of the first parameter with parameter i's signature."""


@functools.lru_cache(maxsize=8)
def _meta_inventory(config_json: str) -> _Inventory:
    """A config's model built on meta, its parameters' checkpoint targets checked against the core once."""
    from .parallel import build_model

    config = json.loads(config_json)
    model = build_model(config, device="meta", seed=None)
    hf = unwrap(model)
    naming = Naming(hf)
    tied = is_tied(hf)
    owner = {}
    for module_name, module in hf.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owner[id(param)] = (tp_style(module_name, module, tied), pname)
    params = []
    for name, param in named_parameters(hf):
        style, leaf = owner[id(param)]
        params.append(_Param(name, tuple(param.shape), tp_shard_dim(style, leaf),
                             tuple(naming.targets(name, tuple(param.shape)))))
    dtype = config_dtype(config)
    specs = tuple(tuple(TensorSpec(t.name, t.shape, dtype) for t in p.targets) for p in params)
    _check_against_core(config, [spec for group in specs for spec in group])
    first: dict[tuple, int] = {}
    kinds = tuple(first.setdefault(p.signature, i) for i, p in enumerate(params))
    return _Inventory(tuple(params), specs, kinds)


def layout_pieces(kind: type[P], config: dict[str, Any], layout: ParallelLayout, rank: int) -> list[P]:
    """The pieces ``rank`` of a standard DTensor layout holds, from the config alone.

    Parameters that differ only in name (the same tensor of every layer) are placed once per rank.
    """
    check_layout(layout)
    coordinate = dict(zip(("dp", "fsdp", "tp"), rank_coordinate(layout, rank)))
    sizes = {"dp": layout.dp, "fsdp": layout.fsdp, "tp": layout.tp}
    inventory = _meta_inventory(json.dumps(config, sort_keys=True))
    placed: dict[int, list[tuple[int, Box]]] = {}
    pieces: list[P] = []
    for param, specs, signature in zip(inventory.params, inventory.specs, inventory.kinds):
        boxes = placed.get(signature)
        if boxes is None:
            dims, placements = predicted_placements(layout, param.tp_dim)
            blocks = local_blocks(param.shape, [sizes[d] for d in dims], [coordinate[d] for d in dims],
                                  placements, what=param.name)
            boxes = placed[signature] = [(p.target, p.hf_box) for p in placements_of(param.targets, blocks)]
            pieces.extend(kind(specs[i], box) for i, box in boxes)  # checked here, for the whole signature
        else:  # the same target shapes (the signature holds them): the boxes were checked above
            pieces.extend(kind.of(specs[i], box) for i, box in boxes)
    return pieces


def _check_against_core(config: dict[str, Any], specs: list[TensorSpec]) -> None:
    try:
        expected = {s.name: s for s in checkpoint_specs(config)}
    except RefitError:  # an architecture the core cannot list from its config: nothing to compare
        return
    found = {s.name: s for s in specs}
    wrong = [f"{n}: {found[n].shape} vs {expected[n].shape}" for n in found
             if n in expected and found[n].shape != expected[n].shape]
    unknown = [n for n in found if n not in expected]
    if wrong or unknown:
        raise PluginError(f"dtensor layout disagrees with the checkpoint inventory: "
                          f"shapes {wrong[:3]}, unknown names {unknown[:3]}")
