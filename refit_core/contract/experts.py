"""Grouping of per-expert HF names into stacked logical tensors.

The checkpoint's ``model.layers.3.mlp.experts.{e}.gate_proj.weight`` (``[I, H]`` each) are one
logical tensor ``model.layers.3.mlp.experts.gate_proj.weight`` of shape ``[E, I, H]``, so expert
parallelism is plain sharding on dim 0. Plugins may emit either form; the planner groups
per-expert names through the ``refit_expert_name`` hook, and the loader path and verification name
experts back through :class:`ExpertNaming`: the per-expert names either side published, else the
``refit_expert_member_name`` hook. The defaults of both hooks (the ``...experts.{e}.{rest}`` naming)
live here, and are the only place that knows that naming.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from refit_core.contract.errors import PlanError, PluginError
from refit_core.contract.pieces import Piece, PieceMeta
from refit_core.contract.spec import Box, TensorSpec

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
    """``("a.experts.w1.weight", 5)`` -> ``"a.experts.5.w1.weight"``: the default naming's expert
    ``index`` of a group that follows it."""
    prefix, _, suffix = group.partition(".experts.")
    return f"{prefix}.experts.{index}.{suffix}"


def default_member_name(group: str, index: int) -> str | None:
    """The inverse of :func:`default_expert_name`; None for a name that is not a group of that naming."""
    name = ungroup_name(group, index)
    return name if default_expert_name(name) == ExpertName(group, index) else None


ExpertNamer = Callable[[str], "ExpertName | None"]
MemberNamer = Callable[[str, int], "str | None"]


def count_experts(names: Iterable[str], namer: ExpertNamer) -> dict[str, int]:
    """Number of experts of every group among per-expert ``names`` (max index + 1)."""
    counts: dict[str, int] = {}
    for name in names:
        expert = namer(name)
        if expert is not None:
            counts[expert.group] = max(counts.get(expert.group, 0), expert.index + 1)
    return counts


def expert_counts(ranks: Sequence[Sequence[PieceMeta]], namer: ExpertNamer) -> dict[str, int]:
    """Number of experts of every group seen across all ranks of one side (max index + 1)."""
    return count_experts((meta.spec.name for metas in ranks for meta in metas), namer)


def group_meta(meta: PieceMeta, namer: ExpertNamer, counts: dict[str, int]) -> PieceMeta:
    """A per-expert piece as a ``[1, ...]`` box of its grouped tensor; other pieces unchanged."""
    expert = namer(meta.spec.name)
    if expert is None:
        return meta
    if expert.group not in counts:
        raise PlanError(f"expert tensor {meta.spec.name} has no group count")
    quant = meta.spec.quant
    if quant is not None:  # the scales are stacked the same way: [E, ...] under their grouped name
        scale = namer(quant.scale_name)
        quant = quant.stacked(scale.group if scale is not None else quant.scale_name)
    spec = TensorSpec(expert.group, (counts[expert.group], *meta.spec.shape), meta.spec.dtype, quant)
    box = Box((expert.index, *meta.box.offsets), (1, *meta.box.sizes))
    return PieceMeta(spec, box)


def group_piece(piece: Piece, namer: ExpertNamer, counts: dict[str, int]) -> Piece:
    """Like :func:`group_meta` for a live piece: the view gains a leading dim of 1."""
    if namer(piece.spec.name) is None:
        return piece
    meta = group_meta(piece.meta, namer, counts)
    view = None if piece.view is None else piece.view.unsqueeze(0)
    return type(piece)(meta.spec, meta.box, view)


def _memoized(namer: ExpertNamer) -> ExpertNamer:
    answers: dict[str, ExpertName | None] = {}

    def named(name: str) -> ExpertName | None:
        if name not in answers:
            answers[name] = namer(name)
        return answers[name]
    return named


@dataclass(frozen=True)
class GroupedSide:
    """One side's metadata with per-expert pieces grouped, and the number of experts per group."""

    metas: list[list[PieceMeta]]
    counts: dict[str, int]


def group_side(ranks: Sequence[Sequence[PieceMeta]], namer: ExpertNamer) -> GroupedSide:
    """Every rank's metadata of one side with per-expert pieces grouped, and the experts per group."""
    namer = _memoized(namer)  # ranks repeat the same few names many times over
    counts = expert_counts(ranks, namer)
    return GroupedSide([[group_meta(m, namer, counts) for m in metas] for metas in ranks], counts)


@dataclass
class ExpertNaming:
    """Both directions between per-expert checkpoint names and grouped tensors.

    ``namer`` splits a per-expert name (the ``refit_expert_name`` hook); ``member`` names expert
    ``index`` of a group (the ``refit_expert_member_name`` hook). Names learned from metadata
    (:meth:`learn`) come first, so a plugin whose pieces carry per-expert names needs no inverse hook.
    """

    namer: ExpertNamer
    member: MemberNamer
    seen: dict[tuple[str, int], str] = field(default_factory=dict)

    def learn(self, ranks: Iterable[Sequence[PieceMeta]]) -> None:
        """Remember every per-expert name in ``ranks``' metadata."""
        for metas in ranks:
            for meta in metas:
                expert = self.namer(meta.spec.name)
                if expert is not None:
                    self.seen[(expert.group, expert.index)] = meta.spec.name

    def member_name(self, group: str, index: int) -> str | None:
        """The checkpoint's name of expert ``index`` of ``group``; None if ``group`` is no expert group."""
        return self.seen.get((group, index)) or self.member(group, index)

    def members(self, group: str, count: int) -> list[str]:
        """The checkpoint's names of experts ``0..count-1`` of ``group``; PluginError if one is unknown."""
        names = [self.member_name(group, e) for e in range(count)]
        missing = [e for e, name in enumerate(names) if name is None]
        if missing:
            raise PluginError(f"no per-expert name for expert(s) {missing[:5]} of {group}: a plugin that groups "
                              "experts under its own naming must implement refit_expert_member_name")
        return [name for name in names if name is not None]

    def ungrouped(self, weights: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Grouped expert tensors split into the checkpoint's per-expert names; others unchanged."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if self.namer(name) is not None or tensor.dim() == 0 or self.member_name(name, 0) is None:
                out.append((name, tensor))
                continue
            out.extend(zip(self.members(name, tensor.shape[0]), tensor.unbind(0)))
        return out
