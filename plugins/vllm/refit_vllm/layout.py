"""Metadata-only destination maps of a vLLM layout (``refit plan``): no engine, no vLLM import.

The live path learns boxes from vLLM's loaders (:mod:`refit_vllm.probe`); this module states the
same rules for a config's checkpoint inventory (``refit_core.models.checkpoint_specs``), by the
tensors' leaf names, as vLLM 0.32 applies them to Llama-like decoders (Llama, Mistral, Qwen2/3,
Qwen2/3-MoE with shared experts, Mixtral, Phi-3's fused checkpoint tensors, OLMo2, Granite, ...),
and the tests check both agree:

- worker rank ``r`` = ``dp_i * (tp * pp) + pp_i * tp + tp_i`` (vLLM's global worker order);
- pipeline stages own ``get_pp_indices`` layer ranges; the first stage owns ``embed_tokens`` (the
  last one too when embeddings are tied), the last owns ``norm`` and ``lm_head``;
- q/k/v and gate/up are column-parallel (q by heads; k/v by KV heads, each rank holding the KV head
  ``tp_i // (tp / kv_heads)`` when tp exceeds the KV-head count), o/down row-parallel (their
  biases replicated); a fused ``qkv_proj`` / ``gate_up_proj`` checkpoint tensor gives each rank
  its q, k, v (gate, up) rows as separate boxes;
- ``embed_tokens`` / ``lm_head`` are vocab-parallel over the vocabulary padded to a multiple of 64
  (each rank holds rows ``[tp_i * V_pad / tp, min((tp_i + 1) * V_pad / tp, V))``);
- MoE experts are tensor-parallel over ``tp * dp`` ranks (``tp_i + dp_i * tp``) or, with ``ep > 1``
  (vLLM's ``enable_expert_parallel``; ``ep`` must be ``tp * dp``), whole experts in contiguous
  blocks of ``E / ep`` per rank; router weights and norms are replicated.
"""

from __future__ import annotations

from typing import Any

from refit_core import Box, DestinationMap, DestinationPiece, ParallelLayout, PluginError, TensorSpec
from refit_core.models import checkpoint_specs, head_dim, num_experts

VOCAB_PADDING = 64


def pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM's ``get_pp_indices`` (without the ``VLLM_PP_LAYER_PARTITION`` override)."""
    per = num_layers // pp_size
    partitions = [per] * pp_size
    for i in range(2, num_layers % pp_size + 2):  # the remainder goes to stages before the last
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def _rows(box_rows: tuple[int, int], shape: tuple[int, ...]) -> Box:
    start, end = box_rows
    return Box((start, *(0,) * (len(shape) - 1)), (end - start, *shape[1:]))


def _cols(box_cols: tuple[int, int], shape: tuple[int, ...]) -> Box:
    start, end = box_cols
    return Box((0, start), (shape[0], end - start))


def _split(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if total % parts:
        raise PluginError(f"vLLM cannot split {what} ({total}) over {parts} ranks")
    size = total // parts
    return index * size, (index + 1) * size


def _check(layout: ParallelLayout) -> None:
    extra = {k: getattr(layout, k) for k in ("vpp", "etp", "fsdp") if getattr(layout, k) != 1}
    if extra:
        raise PluginError(f"vllm layouts take tp, pp, dp and ep; got {extra}")
    if layout.ep > 1 and layout.ep != layout.tp * layout.dp:
        raise PluginError(f"vllm expert parallelism spans tp * dp ranks: ep must be {layout.tp * layout.dp}, "
                          f"got {layout.ep}")


def destination_layout(config: dict[str, Any], layout: ParallelLayout, rank: int) -> DestinationMap:
    """The pieces (views None) vLLM worker ``rank`` of ``layout`` receives for ``config``."""
    _check(layout)
    world = layout.tp * layout.pp * layout.dp
    if not 0 <= rank < world:
        raise PluginError(f"rank {rank} outside a vllm {layout} layout of {world} workers")
    dp_i, within = divmod(rank, layout.tp * layout.pp)
    pp_i, tp_i = divmod(within, layout.tp)
    tp = layout.tp
    first, last = pp_i == 0, pp_i == layout.pp - 1
    lo, hi = pp_layers(config["num_hidden_layers"], pp_i, layout.pp)
    heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], head_dim(config)
    vocab = config["vocab_size"]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    tied = bool(config.get("tie_word_embeddings", False))
    experts = num_experts(config)
    moe_parts, moe_index = tp * layout.dp, dp_i * tp + tp_i

    def vocab_rows() -> tuple[int, int] | None:
        per = padded // tp
        start, end = min(tp_i * per, vocab), min((tp_i + 1) * per, vocab)
        return (start, end) if end > start else None

    q_rows = _split(heads * hd, tp, tp_i, "attention heads")
    if tp >= kv_heads:
        if tp % kv_heads:
            raise PluginError(f"vLLM cannot replicate {kv_heads} KV heads over {tp} ranks")
        kv_head = tp_i // (tp // kv_heads)
        kv_rows = (kv_head * hd, (kv_head + 1) * hd)
    else:
        kv_rows = _split(kv_heads * hd, tp, tp_i, "KV heads")

    pieces: list[DestinationPiece] = []

    def add(spec: TensorSpec, box: Box | None) -> None:
        if box is not None and not box.is_empty():
            pieces.append(DestinationPiece(spec, box))

    for spec in checkpoint_specs(config):
        name, shape = spec.name, spec.shape
        if name == "model.embed_tokens.weight":
            if first or (tied and last):
                rows = vocab_rows()
                add(spec, rows and _rows(rows, shape))
            continue
        if name == "lm_head.weight" or name == "model.norm.weight":
            if last:
                rows = vocab_rows() if name == "lm_head.weight" else (0, shape[0])
                add(spec, rows and _rows(rows, shape))
            continue
        layer = int(name.split(".")[2])
        if not lo <= layer < hi:
            continue
        leaf, kind = name.split(".")[-2:]
        if ".experts." in name:
            add(spec, _expert_box(spec, leaf, experts, layout, moe_parts, moe_index))
        elif leaf == "q_proj":
            add(spec, _rows(q_rows, shape))
        elif leaf in ("k_proj", "v_proj"):
            add(spec, _rows(kv_rows, shape))
        elif leaf == "qkv_proj":  # a checkpoint that stores [q; k; v] fused (Phi-3)
            q_size, kv_size = heads * hd, kv_heads * hd
            for base, rows in ((0, q_rows), (q_size, kv_rows), (q_size + kv_size, kv_rows)):
                add(spec, _rows((base + rows[0], base + rows[1]), shape))
        elif leaf in ("gate_proj", "up_proj"):
            add(spec, _rows(_split(shape[0], tp, tp_i, name), shape))
        elif leaf == "gate_up_proj":  # a checkpoint that stores [gate; up] fused (Phi-3)
            half = shape[0] // 2
            start, end = _split(half, tp, tp_i, name)
            for base in (0, half):
                add(spec, _rows((base + start, base + end), shape))
        elif leaf in ("o_proj", "down_proj") and kind == "weight":
            add(spec, _cols(_split(shape[1], tp, tp_i, name), shape))
        else:  # norms, router gates, row-parallel biases: replicated
            add(spec, spec.full_box())
    return DestinationMap(pieces=pieces)


def _expert_box(spec: TensorSpec, leaf: str, experts: int, layout: ParallelLayout, parts: int,
                index: int) -> Box:
    """Box of a grouped ``[E, out, in]`` expert tensor on one rank."""
    e, out, inp = spec.shape
    if layout.ep > 1:
        start, end = _split(experts, layout.ep, index, "experts")
        return Box((start, 0, 0), (end - start, out, inp))
    if leaf in ("w2", "down_proj"):
        start, end = _split(inp, parts, index, spec.name)
        return Box((0, 0, start), (e, out, end - start))
    start, end = _split(out, parts, index, spec.name)
    return Box((0, start, 0), (e, end - start, inp))
