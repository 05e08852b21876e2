"""Tiny configs of decoder architectures outside refit's built-in table, and model directories of them.

Each is small (hidden 128, 2 layers, fp32, head_dim 32 as the CPU attention kernel wants) and
covers a layout the table never had: Qwen2-MoE (routed experts plus a shared expert and its
``shared_expert_gate``, q/k/v biases), Phi-3 (the checkpoint itself stores fused ``qkv_proj`` and
``gate_up_proj``), OLMo2 (q/k norms over all heads, post-attention and post-feedforward norms).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_BASE: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2-moe": {**_BASE, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "num_experts": 4,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": False},
    "phi3": {**_BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
             "original_max_position_embeddings": 256},
    "olmo2": {**_BASE, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"},
}

CHARACTERISTIC_TENSORS = {
    "qwen2-moe": ("model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.shared_expert.up_proj.weight",
                  "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.q_proj.bias"),
    "phi3": ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    "olmo2": ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
}
"""Tensors that make each architecture what it is: they must be in its checkpoint."""


def write_random_model(name: str, path: str | os.PathLike, seed: int = 7) -> Path:
    """A HF model directory (config.json + model.safetensors, random weights) of ``ARCHITECTURES[name]``."""
    from refit_vllm.reference import write_model_dir

    from refit_core.kit.models import checkpoint_specs, reference_state_dict

    config = ARCHITECTURES[name]
    return write_model_dir(config, reference_state_dict(checkpoint_specs(config, grouped=False), seed, 0), path)
