"""Metadata-only destination pieces of a tensor-parallel decoder engine rank (``refit plan``).

vLLM and SGLang shard the decoder families refit knows from ``config.json`` (Llama, Mistral, Qwen2,
Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3) by the same Megatron-style rules, which live here once:

- q/k/v and gate/up are column-parallel (q by heads; k/v by KV heads, each rank holding the KV head
  ``tp_rank // (tp / kv_heads)`` when tp exceeds the KV-head count), o/down row-parallel (their
  biases replicated); a fused ``qkv_proj`` / ``gate_up_proj`` checkpoint tensor (Phi-3) gives each
  rank its q, k, v (gate, up) rows as separate boxes;
- MLA (DeepSeek-V2/V3, Kimi-K2): ``q_b_proj`` / ``kv_b_proj`` (``q_proj`` without q-LoRA) are
  column-parallel by heads, the down-projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their
  norms replicated (vLLM's and SGLang's ``DeepseekV2Attention``); a multi-token-prediction layer
  (index ``num_hidden_layers``) is not part of the engine's main model;
- ``embed_tokens`` / ``lm_head`` are vocab-parallel over the vocabulary padded to a multiple of
  ``vocab_padding`` (each rank holds rows ``[r * V_pad / tp, min((r + 1) * V_pad / tp, V))``);
- MoE experts: whole experts in contiguous blocks of ``E / ep`` per expert-parallel rank, each block
  tensor-parallel over ``moe_tp`` ranks (w1/w3 by rows, w2 by columns); routers and norms replicated;
- pipeline stages own a layer range; the first stage owns ``embed_tokens`` (the last one too when
  embeddings are tied), the last owns ``norm`` and ``lm_head``.

Each engine plugin maps its rank numbering onto an :class:`EngineRank` (and checks the live pieces
its loaders produce against these in its tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refit_core.contract.errors import PluginError
from refit_core.contract.pieces import DestinationPiece
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import checkpoint_specs, head_dim


@dataclass(frozen=True)
class EngineRank:
    """Where one engine rank sits: its tensor-parallel slot, layers, and expert slots.

    ``layers`` is the ``[start, end)`` range of decoder layers it holds; ``first`` / ``last`` say
    whether it is the first / last pipeline stage; ``ep`` / ``ep_rank`` split experts into blocks,
    ``moe_tp`` / ``moe_tp_rank`` split each expert's matrices; ``engine`` names the engine in errors.
    """

    engine: str
    tp: int
    tp_rank: int
    layers: tuple[int, int]
    first: bool = True
    last: bool = True
    ep: int = 1
    ep_rank: int = 0
    moe_tp: int = 1
    moe_tp_rank: int = 0
    vocab_padding: int = 64


def split_range(total: int, parts: int, index: int, what: str, engine: str, unit: int = 1) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` of ``total`` split evenly into ``parts``, in whole units of ``unit`` (a
    head's rows): the error counts what cannot be split in those units (4 attention heads, not 128 rows)."""
    if (total // unit) % parts:
        counted = f"{what} ({total})" if unit == 1 else f"{total // unit} {what}"
        raise PluginError(f"{engine} cannot split {counted} over {parts} ranks")
    size = total // parts
    return index * size, (index + 1) * size


def _rows(rows: tuple[int, int], shape: tuple[int, ...]) -> Box:
    start, end = rows
    return Box((start, *(0,) * (len(shape) - 1)), (end - start, *shape[1:]))


def _cols(cols: tuple[int, int], shape: tuple[int, ...]) -> Box:
    start, end = cols
    return Box((0, start), (shape[0], end - start))


def decoder_pieces(config: dict[str, Any], rank: EngineRank) -> list[DestinationPiece]:
    """The pieces (views None) ``rank`` receives for a decoder ``config`` (grouped expert names)."""
    tp, tp_i, engine = rank.tp, rank.tp_rank, rank.engine
    lo, hi = rank.layers
    heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], head_dim(config)
    vocab = config["vocab_size"]
    padded = -(-vocab // rank.vocab_padding) * rank.vocab_padding
    tied = bool(config.get("tie_word_embeddings", False))
    mla = bool(config.get("kv_lora_rank"))  # DeepSeek's latent attention: q_a / kv_a projections replicated

    def vocab_rows() -> tuple[int, int] | None:
        per = padded // tp
        start, end = min(tp_i * per, vocab), min((tp_i + 1) * per, vocab)
        return (start, end) if end > start else None

    q_rows = split_range(heads * hd, tp, tp_i, "attention heads", engine, unit=hd)
    if tp >= kv_heads:
        if tp % kv_heads:
            raise PluginError(f"{engine} cannot replicate {kv_heads} KV heads over {tp} ranks")
        kv_head = tp_i // (tp // kv_heads)
        kv_rows = (kv_head * hd, (kv_head + 1) * hd)
    else:
        kv_rows = split_range(kv_heads * hd, tp, tp_i, "KV heads", engine, unit=hd)

    pieces: list[DestinationPiece] = []

    def add(spec: TensorSpec, box: Box | None) -> None:
        if box is not None and not box.is_empty():
            pieces.append(DestinationPiece(spec, box))

    for spec in checkpoint_specs(config):
        name, shape = spec.name, spec.shape
        if name == "model.embed_tokens.weight":
            if rank.first or (tied and rank.last):
                rows = vocab_rows()
                add(spec, rows and _rows(rows, shape))
            continue
        if name in ("lm_head.weight", "model.norm.weight"):
            if rank.last:
                rows = vocab_rows() if name == "lm_head.weight" else (0, shape[0])
                add(spec, rows and _rows(rows, shape))
            continue
        layer = int(name.split(".")[2])
        if not lo <= layer < hi:
            continue
        leaf, kind = name.split(".")[-2:]
        if ".experts." in name:
            add(spec, _expert_box(spec, leaf, spec.shape[0], rank))
        elif leaf in ("q_b_proj", "kv_b_proj") or (leaf == "q_proj" and mla):  # MLA: heads split by rows
            add(spec, _rows(split_range(shape[0], tp, tp_i, name, engine), shape))
        elif leaf == "q_proj":
            add(spec, _rows(q_rows, shape))
        elif leaf in ("k_proj", "v_proj"):
            add(spec, _rows(kv_rows, shape))
        elif leaf == "qkv_proj":  # a checkpoint that stores [q; k; v] fused (Phi-3)
            q_size, kv_size = heads * hd, kv_heads * hd
            for base, rows in ((0, q_rows), (q_size, kv_rows), (q_size + kv_size, kv_rows)):
                add(spec, _rows((base + rows[0], base + rows[1]), shape))
        elif leaf in ("gate_proj", "up_proj"):
            add(spec, _rows(split_range(shape[0], tp, tp_i, name, engine), shape))
        elif leaf == "gate_up_proj":  # a checkpoint that stores [gate; up] fused (Phi-3)
            half = shape[0] // 2
            start, end = split_range(half, tp, tp_i, name, engine)
            for base in (0, half):
                add(spec, _rows((base + start, base + end), shape))
        elif leaf in ("o_proj", "down_proj") and kind == "weight":
            add(spec, _cols(split_range(shape[1], tp, tp_i, name, engine), shape))
        else:  # norms, router gates, row-parallel biases: replicated
            add(spec, spec.full_box())
    return pieces


def _expert_box(spec: TensorSpec, leaf: str, experts: int, rank: EngineRank) -> Box:
    """Box of a grouped ``[E, out, in]`` expert tensor on one rank."""
    _, out, inp = spec.shape
    first, end = split_range(experts, rank.ep, rank.ep_rank, "experts", rank.engine)
    if leaf in ("w2", "down_proj"):
        start, stop = split_range(inp, rank.moe_tp, rank.moe_tp_rank, spec.name, rank.engine)
        return Box((first, 0, start), (end - first, out, stop - start))
    start, stop = split_range(out, rank.moe_tp, rank.moe_tp_rank, spec.name, rank.engine)
    return Box((first, start, 0), (end - first, stop - start, inp))
