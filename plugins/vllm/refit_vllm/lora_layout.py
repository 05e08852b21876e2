"""Metadata-only adapter maps of a vLLM layout (``refit plan`` in adapter mode): no engine, no vLLM import.

The live path learns where each adapter box lands from vLLM's own ``set_lora`` (:mod:`refit_vllm.lora`);
this module states the same rules for Llama-like decoders, by module name, as vLLM 0.32's LoRA layers
apply them (the tests check both agree on a live TP-2 engine):

- column-parallel modules (``q_proj`` / ``k_proj`` / ``v_proj`` in ``qkv_proj``, ``gate_proj`` /
  ``up_proj`` in ``gate_up_proj``): A whole on every rank, B by output rows -- q by heads, k / v by
  KV heads (each rank holding KV head ``tp_i // (tp / kv_heads)`` when tp exceeds them), gate / up by
  intermediate rows;
- row-parallel modules (``o_proj``, ``down_proj``): A by input columns, B whole on every rank;
- worker rank ``r`` = ``dp_i * tp + tp_i``; data-parallel replicas hold the same boxes.
"""

from __future__ import annotations

from typing import Any

import torch

from refit_core import Box, DestinationMap, DestinationPiece, LoraSpec, ParallelLayout, PlanError, TensorSpec
from refit_core import adapter_tensor_names as names_of
from refit_core.kit import config_dtype

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _rows(config: dict[str, Any], module: str, tp: int, tp_i: int) -> tuple[int, int, int, int]:
    """``(in_features, out_features, first output row, output rows)`` this rank holds of ``module``."""
    hidden, layers_heads = config["hidden_size"], config["num_attention_heads"]
    head = config.get("head_dim") or hidden // layers_heads
    kv_heads = config.get("num_key_value_heads") or layers_heads
    q, kv, inter = layers_heads * head, kv_heads * head, config["intermediate_size"]
    if module == "q_proj":
        return hidden, q, tp_i * q // tp, q // tp
    if module in ("k_proj", "v_proj"):
        if tp <= kv_heads:
            return hidden, kv, tp_i * kv // tp, kv // tp
        return hidden, kv, (tp_i // (tp // kv_heads)) * head, head
    if module in ("gate_proj", "up_proj"):
        return hidden, inter, tp_i * inter // tp, inter // tp
    if module == "o_proj":
        return q, hidden, 0, hidden
    return inter, hidden, 0, hidden  # down_proj


def adapter_destination_layout(config: dict[str, Any], spec: LoraSpec, layout: ParallelLayout, rank: int,
                               dtype: torch.dtype | None = None) -> DestinationMap:
    """The adapter pieces (views None) vLLM worker ``rank`` of ``layout`` receives for ``spec`` on a model of
    ``config``, in ``dtype`` (vLLM's ``lora_dtype``; default: the model's). :class:`~refit_core.PlanError`
    for what adapter mode does not write: other parallelism than tp / dp, MoE MLPs, other modules."""
    extra = {k: getattr(layout, k) for k in ("pp", "vpp", "ep", "etp", "fsdp") if getattr(layout, k) != 1}
    if extra:
        raise PlanError(f"vllm adapter mode lays out tp and dp only; got {extra}")
    unknown = [t for t in spec.targets if t not in ATTENTION + MLP]
    if unknown:
        raise PlanError(f"refit adapter {spec.name!r}: target module(s) {unknown} are not LoRA layers of a "
                        f"Llama-like vLLM decoder (it adapts {sorted(ATTENTION + MLP)})")
    moe = [k for k in MOE_KEYS if config.get(k)]
    mlp = [t for t in spec.targets if t in MLP]
    if moe and mlp:
        raise PlanError(f"refit adapter {spec.name!r}: target {mlp[0]} is held by MoE experts ({moe[0]}="
                        f"{config[moe[0]]}): adapter mode does not write MoE LoRA slots; use LoraMode.MERGED")
    if not 0 <= rank < layout.tp * layout.dp:
        raise PlanError(f"rank {rank} outside a vllm {layout} layout of {layout.tp * layout.dp} workers")
    tp, tp_i = layout.tp, rank % layout.tp
    dtype = dtype or config_dtype(config)
    r = spec.rank
    pieces = []
    for layer in range(config["num_hidden_layers"]):
        for target in spec.targets:
            module = f"model.layers.{layer}.{'self_attn' if target in ATTENTION else 'mlp'}.{target}"
            a, b = names_of(module)
            fan_in, fan_out, first, rows = _rows(config, target, tp, tp_i)
            a_spec, b_spec = TensorSpec(a, (r, fan_in), dtype), TensorSpec(b, (fan_out, r), dtype)
            if target in ROW_PARALLEL:
                part = fan_in // tp
                pieces += [DestinationPiece(a_spec, Box((0, tp_i * part), (r, part))),
                           DestinationPiece(b_spec, Box((0, 0), (fan_out, r)))]
            else:
                pieces += [DestinationPiece(a_spec, Box((0, 0), (r, fan_in))),
                           DestinationPiece(b_spec, Box((first, 0), (rows, r)))]
    return DestinationMap(pieces=pieces)


__all__ = ["adapter_destination_layout"]
