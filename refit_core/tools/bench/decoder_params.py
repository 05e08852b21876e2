"""The parameter names of the bench's two synthetic layouts, one name per fused decoder part."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderParams:
    """Where a layout keeps each part of a decoder: the whole-model parameters' names, ``layer`` (the
    prefix of layer ``{}``), and each per-layer parameter's name after that prefix."""

    embedding: str
    layer: str
    in_norm: str
    qkv: str
    q_norm: str
    k_norm: str
    o: str
    post_norm: str
    router: str
    gate_up: str
    down: str
    final_norm: str
    output: str


MEGATRON_PARAMS = DecoderParams(
    embedding="embedding.word_embeddings.weight", layer="decoder.layers.{}",
    in_norm="self_attention.linear_qkv.layer_norm_weight", qkv="self_attention.linear_qkv.weight",
    q_norm="self_attention.q_layernorm.weight", k_norm="self_attention.k_layernorm.weight",
    o="self_attention.linear_proj.weight", post_norm="mlp.linear_fc1.layer_norm_weight",
    router="mlp.router.weight", gate_up="mlp.linear_fc1.weight", down="mlp.linear_fc2.weight",
    final_norm="decoder.final_layernorm.weight", output="output_layer.weight")
"""Megatron-core's names (``linear_qkv`` with its input norm fused in, ``linear_fc1`` = ``[gate; up]``)."""

VLLM_PARAMS = DecoderParams(
    embedding="model.embed_tokens.weight", layer="model.layers.{}",
    in_norm="input_layernorm.weight", qkv="self_attn.qkv_proj.weight",
    q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight",
    o="self_attn.o_proj.weight", post_norm="post_attention_layernorm.weight",
    router="mlp.gate.weight", gate_up="mlp.gate_up_proj.weight", down="mlp.down_proj.weight",
    final_norm="model.norm.weight", output="lm_head.weight")
"""vLLM's names (``qkv_proj`` = ``[Q; K; V]``, ``gate_up_proj`` = ``[gate; up]``)."""

__all__ = ["MEGATRON_PARAMS", "VLLM_PARAMS", "DecoderParams"]
