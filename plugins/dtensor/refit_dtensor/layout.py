"""Metadata-only pieces of a ``dtensor:fsdp=F,tp=T,dp=D`` layout (``refit plan``): nothing allocated.

The model is instantiated on the meta device (no memory, ~0.1 s even for a 30B-parameter shape)
so parameter names, shapes and fusions are exactly the live model's; the standard placements of
``parallel.py`` are predicted per parameter and turned into boxes by the same code as the live
path (``placements.local_blocks``, ``shards.param_pieces``). The result is checked against the
core's ``checkpoint_specs(config)`` where the core knows the architecture. Rank order: see
:mod:`refit_dtensor.parallel` (mesh ``(dp, fsdp, tp)``, tp fastest).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from refit_core import ParallelLayout, PluginError, RefitError
from refit_core.models import checkpoint_specs, config_dtype
from refit_core.pieces import Piece

from .names import Naming, named_parameters, unwrap
from .parallel import check_layout, is_tied, rank_coordinate, tp_shard_dim, tp_style
from .placements import local_blocks
from .shards import param_pieces


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


@functools.lru_cache(maxsize=8)
def _meta_inventory(config_json: str) -> list[tuple[str, tuple[int, ...], int | None, tuple]]:
    """``(param name, shape, tp dim, checkpoint targets)`` of a config's model, built on meta."""
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
    inventory = []
    for name, param in named_parameters(hf):
        style, leaf = owner[id(param)]
        inventory.append((name, tuple(param.shape), tp_shard_dim(style, leaf),
                          tuple(naming.targets(name, tuple(param.shape)))))
    return inventory


def layout_pieces(kind: type[Piece], config: dict[str, Any], layout: ParallelLayout, rank: int) -> list[Piece]:
    """The pieces ``rank`` of a standard DTensor layout holds, from the config alone."""
    check_layout(layout)
    coordinate = dict(zip(("dp", "fsdp", "tp"), rank_coordinate(layout, rank)))
    sizes = {"dp": layout.dp, "fsdp": layout.fsdp, "tp": layout.tp}
    dtype = config_dtype(config)
    pieces: list[Piece] = []
    for name, shape, tp_dim, targets in _meta_inventory(json.dumps(config, sort_keys=True)):
        dims, placements = predicted_placements(layout, tp_dim)
        blocks = local_blocks(shape, [sizes[d] for d in dims], [coordinate[d] for d in dims],
                              placements, what=name)
        pieces.extend(param_pieces(kind, targets, dtype, blocks, None))
    _check_against_core(config, pieces)
    return pieces


def _check_against_core(config: dict[str, Any], pieces: list[Piece]) -> None:
    try:
        expected = {s.name: s for s in checkpoint_specs(config)}
    except RefitError:  # an architecture the core cannot list from its config: nothing to compare
        return
    found = {p.spec.name: p.spec for p in pieces}
    wrong = [f"{n}: {found[n].shape} vs {expected[n].shape}" for n in found
             if n in expected and found[n].shape != expected[n].shape]
    unknown = [n for n in found if n not in expected]
    if wrong or unknown:
        raise PluginError(f"dtensor layout disagrees with the checkpoint inventory: "
                          f"shapes {wrong[:3]}, unknown names {unknown[:3]}")
