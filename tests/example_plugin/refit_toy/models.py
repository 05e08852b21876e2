"""The toy models: plain dicts of tensors with a sharding rule each."""

from __future__ import annotations

import re

import torch

from refit_core import ExpertName, TensorSpec

HIDDEN, VOCAB, HEADS_DIM, KV_DIM, EXPERTS, EXPERT_ROWS = 32, 64, 32, 16, 4, 8

# The HF checkpoint this toy model family corresponds to (per-expert names, as a checkpoint has).
CHECKPOINT = [
    TensorSpec("model.embed_tokens.weight", (VOCAB, HIDDEN), torch.float32),
    TensorSpec("model.layers.0.self_attn.q_proj.weight", (HEADS_DIM, HIDDEN), torch.float32),
    TensorSpec("model.layers.0.self_attn.k_proj.weight", (KV_DIM, HIDDEN), torch.float32),
    TensorSpec("model.layers.0.self_attn.v_proj.weight", (KV_DIM, HIDDEN), torch.float32),
    *[TensorSpec(f"model.layers.0.mlp.experts.{e}.up_proj.weight", (EXPERT_ROWS, HIDDEN), torch.float32)
      for e in range(EXPERTS)],
    TensorSpec("model.norm.weight", (HIDDEN,), torch.float32),
]
GROUPED_EXPERTS = "model.layers.0.mlp.experts.up_proj.weight"

# A second naming of the same checkpoint's experts, without ``.experts.``:
# ``model.layers.0.moe.expert{e}_up.weight`` is expert ``e`` of the group ``model.layers.0.moe.up.weight``.
# The toy plugin's two expert-naming hooks translate it; the core's default naming knows nothing of it.
ODD_GROUPED_EXPERTS = "model.layers.0.moe.up.weight"
_ODD_EXPERT = re.compile(r"^(?P<prefix>.+\.moe)\.expert(?P<index>\d+)_(?P<rest>[^.]+\.weight)$")
_ODD_GROUP = re.compile(r"^(?P<prefix>.+\.moe)\.(?P<rest>[^.]+\.weight)$")


def odd_expert_name(name: str) -> ExpertName | None:
    """``model.layers.0.moe.expert3_up.weight`` -> ``ExpertName("model.layers.0.moe.up.weight", 3)``."""
    match = _ODD_EXPERT.match(name)
    return None if match is None else ExpertName(f"{match['prefix']}.{match['rest']}", int(match["index"]))


def odd_member_name(group: str, index: int) -> str | None:
    """The inverse of :func:`odd_expert_name`."""
    match = _ODD_GROUP.match(group)
    return None if match is None else f"{match['prefix']}.expert{index}_{match['rest']}"


ODD_CHECKPOINT = [
    *(s for s in CHECKPOINT if ".experts." not in s.name),
    *[TensorSpec(odd_member_name(ODD_GROUPED_EXPERTS, e), (EXPERT_ROWS, HIDDEN), torch.float32)
      for e in range(EXPERTS)],
]


def checkpoint(odd_experts: bool) -> list[TensorSpec]:
    return ODD_CHECKPOINT if odd_experts else CHECKPOINT


def _expert_index(name: str) -> int | None:
    odd = odd_expert_name(name)
    if odd is not None:
        return odd.index
    if ".experts." in name:
        return int(name.split(".experts.")[1].split(".")[0])
    return None


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` when ``n`` is cut into ``parts`` near-equal parts."""
    cuts = [n * i // parts for i in range(parts + 1)]
    return cuts[index], cuts[index + 1] - cuts[index]


class ToyTrainer:
    """Train side: every dense tensor row-sharded over ``world`` ranks, experts split by index
    (whole experts per rank, per-expert names), the final norm replicated on every rank.
    ``odd_experts`` names experts with the plugin's own scheme instead of HF's."""

    def __init__(self, rank: int, world: int, shape_overrides: dict[str, tuple[int, ...]] | None = None,
                 device: str = "cpu", odd_experts: bool = False) -> None:
        self.rank, self.world = rank, world
        self.specs = [TensorSpec(s.name, (shape_overrides or {}).get(s.name, s.shape), s.dtype)
                      for s in checkpoint(odd_experts)]
        self.shards: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        for spec in self.specs:
            expert = _expert_index(spec.name)
            if expert is not None:
                if expert * world // EXPERTS == rank:
                    self.shards[spec.name] = ((0,) * len(spec.shape), torch.zeros(spec.shape, device=device))
            elif spec.name == "model.norm.weight":
                self.shards[spec.name] = ((0,), torch.zeros(spec.shape, device=device))
            else:
                start, size = split(spec.shape[0], world, rank)
                self.shards[spec.name] = ((start, 0), torch.zeros(size, *spec.shape[1:], device=device))

    def load(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's part of a full state dict into the shards (in place)."""
        for name, (offsets, shard) in self.shards.items():
            region = full[name]
            for dim, (o, s) in enumerate(zip(offsets, shard.shape)):
                region = region.narrow(dim, o, s)
            shard.copy_(region)


class ToyEngine:
    """Gen side: embeddings column-sharded (bf16), a fused ``qkv`` replicated on every rank,
    stacked experts ``[E, rows, H]`` sharded on the expert dim, the norm replicated.

    ``odd_experts`` names experts with the plugin's own scheme and takes them through the loader
    path: refit hands them to ``refit_load_weights`` under their per-expert checkpoint names, which
    the engine records in ``loaded_names`` and copies into its local experts.
    """

    def __init__(self, rank: int, world: int, device: str = "cpu", odd_experts: bool = False) -> None:
        self.rank, self.world = rank, world
        self.odd_experts = odd_experts
        self.col_start, cols = split(HIDDEN, world, rank)
        self.expert_start, experts = split(EXPERTS, world, rank)
        self.embed = torch.zeros(VOCAB, cols, dtype=torch.bfloat16, device=device)
        self.qkv = torch.zeros(HEADS_DIM + 2 * KV_DIM, HIDDEN, device=device)
        self.experts_up = torch.zeros(experts, EXPERT_ROWS, HIDDEN, device=device)
        self.norm = torch.zeros(HIDDEN, device=device)
        self.version = -1
        self.loaded_names: list[str] = []
        self.torn: set[str] = set()  # tensors a failed refit left partly written

    def serve(self) -> int:
        """What an engine does between refits; refuses while a failed refit left torn weights."""
        if self.torn:
            raise RuntimeError(f"toy engine: refusing to serve torn weights {sorted(self.torn)}; refit first")
        return self.version

    def load_checkpoint(self, full: dict[str, torch.Tensor]) -> None:
        """The engine loading a whole checkpoint (per-expert names) by its own rules, as at start-up:
        this rank's embedding columns, ``[q; k; v]`` fused, its experts, the norm."""
        cols = self.embed.shape[1]
        self.embed.copy_(full["model.embed_tokens.weight"][:, self.col_start:self.col_start + cols])
        attn = "model.layers.0.self_attn"
        self.qkv.copy_(torch.cat([full[f"{attn}.{p}_proj.weight"] for p in ("q", "k", "v")]))
        for name, tensor in full.items():
            expert = _expert_index(name)
            if expert is not None and 0 <= expert - self.expert_start < self.experts_up.shape[0]:
                self.experts_up[expert - self.expert_start].copy_(tensor)
        self.norm.copy_(full["model.norm.weight"])

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """The engine's own loader: per-expert checkpoint tensors into its local experts."""
        self.loaded_names = [name for name, _ in weights]
        for name, tensor in weights:
            expert = odd_expert_name(name)
            if expert is None or expert.group != ODD_GROUPED_EXPERTS:
                raise KeyError(f"toy engine: unexpected loader tensor {name}")
            local = expert.index - self.expert_start
            if 0 <= local < self.experts_up.shape[0]:
                self.experts_up[local].copy_(tensor)
