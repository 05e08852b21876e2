"""Grouping of per-expert HF names into stacked logical tensors.

The checkpoint's ``model.layers.3.mlp.experts.{e}.gate_proj.weight`` (``[I, H]`` each) are one
logical tensor ``model.layers.3.mlp.experts.gate_proj.weight`` of shape ``[E, I, H]``, so expert
parallelism is plain sharding on dim 0. Plugins may emit either form; the planner groups
per-expert names through the ``refit_expert_name`` hook (whose default lives here).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import PlanError
from .pieces import Piece, PieceMeta
from .spec import Box, TensorSpec

_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<suffix>.+)$")


@dataclass(frozen=True)
class ExpertName:
    """A per-expert HF name, split into its grouped name and its expert index."""

    group: str
    index: int


def default_expert_name(hf_name: str) -> ExpertName | None:
    """``a.experts.5.w1.weight`` -> ``ExpertName("a.experts.w1.weight", 5)``; other names -> None."""
    match = _EXPERT_NAME.match(hf_name)
    if match is None:
        return None
    return ExpertName(f"{match['prefix']}.{match['suffix']}", int(match["index"]))


def ungroup_name(group: str, index: int) -> str:
    """The per-expert HF name of expert ``index`` of a grouped name (inverse of the default)."""
    prefix, _, suffix = group.partition(".experts.")
    return f"{prefix}.experts.{index}.{suffix}"


ExpertNamer = Callable[[str], "ExpertName | None"]


def expert_counts(ranks: Sequence[Sequence[PieceMeta]], namer: ExpertNamer) -> dict[str, int]:
    """Number of experts of every group seen across all ranks of one side (max index + 1)."""
    counts: dict[str, int] = {}
    for metas in ranks:
        for meta in metas:
            expert = namer(meta.spec.name)
            if expert is not None:
                counts[expert.group] = max(counts.get(expert.group, 0), expert.index + 1)
    return counts


def group_meta(meta: PieceMeta, namer: ExpertNamer, counts: dict[str, int]) -> PieceMeta:
    """A per-expert piece as a ``[1, ...]`` box of its grouped tensor; other pieces unchanged."""
    expert = namer(meta.spec.name)
    if expert is None:
        return meta
    if expert.group not in counts:
        raise PlanError(f"expert tensor {meta.spec.name} has no group count")
    spec = TensorSpec(expert.group, (counts[expert.group], *meta.spec.shape), meta.spec.dtype)
    box = Box((expert.index, *meta.box.offsets), (1, *meta.box.sizes))
    return PieceMeta(spec, box)


def group_piece(piece: Piece, namer: ExpertNamer, counts: dict[str, int]) -> Piece:
    """Like :func:`group_meta` for a live piece: the view gains a leading dim of 1."""
    if namer(piece.spec.name) is None:
        return piece
    meta = group_meta(piece.meta, namer, counts)
    view = None if piece.view is None else piece.view.unsqueeze(0)
    return type(piece)(meta.spec, meta.box, view)


def group_side(ranks: Sequence[Sequence[PieceMeta]], namer: ExpertNamer
               ) -> tuple[list[list[PieceMeta]], dict[str, int]]:
    """Every rank's metadata of one side with per-expert pieces grouped, and the experts per group."""
    counts = expert_counts(ranks, namer)
    return [[group_meta(m, namer, counts) for m in metas] for metas in ranks], counts
