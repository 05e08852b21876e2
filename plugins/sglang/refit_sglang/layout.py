"""Metadata-only destination maps of an SGLang layout (``refit plan --gen sglang:tp=..``): no SGLang import.

The live path learns boxes from SGLang's own loaders (:mod:`refit_sglang.probe`); this module maps
SGLang's rank numbering onto the core's tensor-parallel decoder rules (:mod:`refit_core.kit.tplayout`)
as sglang 0.5.23 applies them, and the tests check both agree on real SGLang models:

- engine replica ``dp_i`` (a separate SGLang engine, or DP group) holds ranks ``dp_i * tp + tp_i``;
- vocab-parallel embeddings pad the vocabulary to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``);
- MoE layers (``FusedMoE``): ``moe_ep_size = ep`` blocks of ``E / ep`` whole experts, each block
  tensor-parallel over ``moe_tp_size = tp / ep`` ranks; TP rank ``r`` is expert-parallel rank
  ``r // moe_tp_size`` and expert-TP rank ``r % moe_tp_size`` (SGLang's ``_MOE_EP`` / ``_MOE_TP``
  groups within one TP group).
"""

from __future__ import annotations

from typing import Any

from refit_core import DestinationMap, ParallelLayout, PluginError
from refit_core.kit import EngineRank, decoder_pieces

VOCAB_PADDING = 64
"""``sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``."""


def destination_layout(config: dict[str, Any], layout: ParallelLayout, rank: int) -> DestinationMap:
    """The pieces (views None) SGLang TP worker ``rank`` of ``layout`` receives for ``config``."""
    extra = {k: getattr(layout, k) for k in ("pp", "vpp", "etp", "fsdp") if getattr(layout, k) != 1}
    if extra:
        raise PluginError(f"sglang layouts take tp, ep and dp; got {extra}")
    if layout.tp % layout.ep:
        raise PluginError(f"sglang expert parallelism splits the TP group: ep ({layout.ep}) must divide "
                          f"tp ({layout.tp})")
    world = layout.tp * layout.dp
    if not 0 <= rank < world:
        raise PluginError(f"rank {rank} outside an sglang {layout} layout of {world} TP workers")
    tp_i = rank % layout.tp
    moe_tp = layout.tp // layout.ep
    slot = EngineRank("SGLang", layout.tp, tp_i, (0, config["num_hidden_layers"]), ep=layout.ep,
                      ep_rank=tp_i // moe_tp, moe_tp=moe_tp, moe_tp_rank=tp_i % moe_tp,
                      vocab_padding=VOCAB_PADDING)
    return DestinationMap(pieces=decoder_pieces(config, slot))
