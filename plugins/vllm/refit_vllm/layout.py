"""Metadata-only destination maps of a vLLM layout (``refit plan``): no engine, no vLLM import.

The live path learns boxes from vLLM's loaders (:mod:`refit_vllm.probe`); this module maps vLLM's
worker numbering onto the core's tensor-parallel decoder rules (:mod:`refit_core.kit.tplayout`, shared
with SGLang), which state the same rules for a config's checkpoint inventory
(``refit_core.kit.models.checkpoint_specs``), by the tensors' leaf names, as vLLM 0.32 applies them to
Llama-like decoders (Llama, Mistral, Qwen2/3, Qwen2/3-MoE with shared experts, Mixtral, Phi-3's
fused checkpoint tensors, OLMo2, Granite, ...),
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

from refit_core import DestinationMap, ParallelLayout, PluginError
from refit_core.kit import EngineRank, decoder_pieces

VOCAB_PADDING = 64


def pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM's ``get_pp_indices`` (without the ``VLLM_PP_LAYER_PARTITION`` override)."""
    per = num_layers // pp_size
    partitions = [per] * pp_size
    for i in range(2, num_layers % pp_size + 2):  # the remainder goes to stages before the last
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def _check(layout: ParallelLayout) -> None:
    extra = {k: getattr(layout, k) for k in ("vpp", "etp", "fsdp") if getattr(layout, k) != 1}
    if layout.uneven:  # vLLM splits layers its own way (pp_layers)
        extra.update(pp_first=layout.pp_first, pp_last=layout.pp_last)
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
    moe_parts, moe_index = layout.tp * layout.dp, dp_i * layout.tp + tp_i
    ep, ep_rank = (moe_parts, moe_index) if layout.ep > 1 else (1, 0)
    moe_tp, moe_tp_rank = (1, 0) if layout.ep > 1 else (moe_parts, moe_index)
    slot = EngineRank("vLLM", layout.tp, tp_i, pp_layers(config["num_hidden_layers"], pp_i, layout.pp),
                      first=pp_i == 0, last=pp_i == layout.pp - 1, ep=ep, ep_rank=ep_rank, moe_tp=moe_tp,
                      moe_tp_rank=moe_tp_rank, vocab_padding=VOCAB_PADDING)
    return DestinationMap(pieces=decoder_pieces(config, slot))
