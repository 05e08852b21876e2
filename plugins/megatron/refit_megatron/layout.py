"""Metadata-only pieces of ``megatron:tp=..,pp=..,vpp=..,ep=..,etp=..,dp=..`` (``refit plan``).

Nothing is built: which parameters a rank holds follows from the HF inventory (``checkpoint.py``)
and the family table (local spec, ``SequentialMLP`` experts), their local shapes from the HF
shapes and the split, and the pieces from the same :func:`~refit_megatron.rules.pieces_of` as the
live path. Ranks are numbered as megatron-core's ``initialize_model_parallel`` does (order
``tp-cp-ep-dp-pp``): ``rank = tp + TP * (dp + DP * pp)``; expert ranks ``etp + ETP * (ep + EP * edp)``
within a pipeline stage. Layers are split over the stages as megatron-core splits them
(:mod:`refit_megatron.stages`): evenly, chunk ``vp`` of stage ``pp`` holding global layers
``(vp * PP + pp) * n + i``, or with the first / last stage's own count (``pp_first=N``,
``pp_last=N``: megatron's ``num_layers_in_first_pipeline_stage`` / ``..._last_...``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refit_core import ParallelLayout, PluginError, SourcePiece, TensorSpec
from refit_core.kit import config_dtype

from .build import padded_vocab
from .checkpoint import hf_specs, in_checkpoint_order
from .facts import ModelFacts
from .families import MTP, Kind, Rule
from .rules import Param, Split, pieces_of
from .stages import check_stages, stage_layers


@dataclass(frozen=True)
class Coordinates:
    """A megatron rank's coordinates in every group."""

    tp: int
    dp: int
    pp: int
    etp: int
    ep: int


def coordinates(layout: ParallelLayout, rank: int) -> Coordinates:
    """Where ``rank`` sits in megatron-core's groups for ``layout`` (``fsdp`` must be 1)."""
    if layout.fsdp != 1:
        raise PluginError("megatron layouts have no fsdp degree; use dp")
    if not 0 <= rank < layout.world_size:
        raise PluginError(f"rank {rank} is outside the layout's {layout.world_size} ranks")
    per_stage = layout.tp * layout.dp
    if per_stage % (layout.ep * layout.etp):
        raise PluginError(f"ep {layout.ep} x etp {layout.etp} must divide tp {layout.tp} x dp {layout.dp}")
    pp, inner = divmod(rank, per_stage)
    dp, tp = divmod(inner, layout.tp)
    ep = inner // layout.etp % layout.ep
    return Coordinates(tp, dp, pp, inner % layout.etp, ep)


def layout_pieces(config: dict[str, Any], layout: ParallelLayout, rank: int) -> list[SourcePiece]:
    """The pieces ``rank`` of a megatron layout holds, from the HF config alone (views None)."""
    facts = ModelFacts.of(config)
    where = coordinates(layout, rank)
    inventory = hf_specs(config)
    dtype = config_dtype(config)
    stages = layout.pp * layout.vpp
    check_stages(facts.layers, layout)
    if facts.family.hybrid and layout.vpp > 1:
        raise PluginError("megatron-core's MambaStack (hybrid NemotronH) has no virtual pipeline parallelism; "
                          "use vpp=1")
    if facts.experts % layout.ep:
        raise PluginError(f"{facts.experts} experts do not split over ep {layout.ep}")
    maker = _Maker(facts, layout, where, inventory, dtype)
    pieces: list[SourcePiece] = []
    for vp in range(layout.vpp):
        stage = vp * layout.pp + where.pp
        top = facts.family.top
        if stage == 0:
            pieces += maker.top(EMBEDDING)
        for layer in stage_layers(facts.layers, layout, where.pp, vp):
            pieces += maker.layer(config, layer)
        if stage == stages - 1:
            for k in range(facts.mtp_layers):
                pieces += maker.mtp(config, facts.layers + k)
            for name in top:
                if name not in (EMBEDDING, OUTPUT):
                    pieces += maker.top(name)  # the final norm
            if not facts.tied:
                pieces += maker.top(OUTPUT)
    return in_checkpoint_order(config, pieces)


EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


class _Maker:
    """Pieces of one rank's parameters, derived from HF shapes."""

    def __init__(self, facts: ModelFacts, layout: ParallelLayout, where: Coordinates,
                 inventory: dict[str, TensorSpec], dtype: torch.dtype) -> None:
        self.facts, self.layout, self.where, self.inventory, self.dtype = facts, layout, where, inventory, dtype
        self.tp = Split(layout.tp, where.tp)
        self.etp = Split(layout.etp, where.etp)
        self.local_experts = facts.experts // layout.ep if facts.experts else 0

    def top(self, name: str) -> list[SourcePiece]:
        rule = self.facts.family.top[name]
        return self._pieces(name, rule, rule.hf, self.tp)

    def layer(self, config: dict[str, Any], layer: int) -> list[SourcePiece]:
        return self._rules(self.facts.family.layer_rules(config, layer), self.facts.layer_prefix(layer))

    def mtp(self, config: dict[str, Any], layer: int) -> list[SourcePiece]:
        prefix = self.facts.layer_prefix(layer)
        return self._rules(MTP, prefix) + self._rules(self.facts.family.layer_rules(config, layer), prefix)

    def _rules(self, rules: dict[str, Rule], prefix: str) -> list[SourcePiece]:
        out: list[SourcePiece] = []
        for name, rule in rules.items():
            if rule.te or rule.kind in (Kind.GROUPED_GLU, Kind.GROUPED_DOWN):
                continue  # metadata describes the local spec with SequentialMLP experts
            hf = tuple(prefix + n for n in rule.hf)
            if "{i}" not in name:
                if all(n in self.inventory for n in hf):
                    out += self._pieces(name, rule, hf, self.tp)
                continue
            for i in range(self.local_experts):
                e = self.where.ep * self.local_experts + i
                expert_hf = tuple(n.replace("{e}", str(e)) for n in hf)
                if all(n in self.inventory for n in expert_hf):
                    out += self._pieces(name.replace("{i}", str(i)), rule, expert_hf, self.etp)
        return out

    def _pieces(self, name: str, rule: Rule, hf: tuple[str, ...], group: Split) -> list[SourcePiece]:
        split = Split(group.size, group.rank, rule.tp_dim) if rule.tp_dim is not None else Split()
        shape = self._local_shape(rule, hf, split)
        dtype = torch.float32 if rule.buffer else self.dtype
        return pieces_of(rule, Param(name, shape, dtype, hf), split, attention=self.facts.attention,
                         vocab=self.facts.vocab, mamba=self.facts.mamba)

    def _local_shape(self, rule: Rule, hf: tuple[str, ...], split: Split) -> tuple[int, ...]:
        shapes = [self.inventory[n].shape for n in hf]
        first = list(shapes[0])
        if rule.kind is Kind.VOCAB:
            first[0] = padded_vocab(first[0], self.layout.tp) // split.size
            return tuple(first)
        if rule.kind in (Kind.QKV, Kind.GLU):
            first[0] = sum(s[0] for s in shapes) // split.size
            return tuple(first)
        if split.dim is not None:
            first[split.dim] //= split.size
        return tuple(first)
