"""The toy models: plain dicts of tensors with a sharding rule each."""

from __future__ import annotations

import torch

from refit_core.spec import TensorSpec

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


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` when ``n`` is cut into ``parts`` near-equal parts."""
    cuts = [n * i // parts for i in range(parts + 1)]
    return cuts[index], cuts[index + 1] - cuts[index]


class ToyTrainer:
    """Train side: every dense tensor row-sharded over ``world`` ranks, experts split by index
    (whole experts per rank, per-expert names), the final norm replicated on every rank."""

    def __init__(self, rank: int, world: int, shape_overrides: dict[str, tuple[int, ...]] | None = None,
                 device: str = "cpu") -> None:
        self.rank, self.world = rank, world
        self.specs = [TensorSpec(s.name, (shape_overrides or {}).get(s.name, s.shape), s.dtype) for s in CHECKPOINT]
        self.shards: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        for spec in self.specs:
            if ".experts." in spec.name:
                expert = int(spec.name.split(".experts.")[1].split(".")[0])
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
    stacked experts ``[E, rows, H]`` sharded on the expert dim, the norm replicated."""

    def __init__(self, rank: int, world: int, device: str = "cpu") -> None:
        self.rank, self.world = rank, world
        self.col_start, cols = split(HIDDEN, world, rank)
        self.expert_start, experts = split(EXPERTS, world, rank)
        self.embed = torch.zeros(VOCAB, cols, dtype=torch.bfloat16, device=device)
        self.qkv = torch.zeros(HEADS_DIM + 2 * KV_DIM, HIDDEN, device=device)
        self.experts_up = torch.zeros(experts, EXPERT_ROWS, HIDDEN, device=device)
        self.norm = torch.zeros(HIDDEN, device=device)
        self.version = -1
