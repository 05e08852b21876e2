"""Model presets and the HF checkpoint inventory of the decoder families refit knows from config alone.

``checkpoint_specs(config)`` lists the tensors of a HF checkpoint (names, shapes, dtypes) from its
``config.json`` for Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral; metadata-only layouts (``refit plan``)
and the demo's reference weights are built on it, so no model has to be instantiated.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from .errors import RefitError
from .experts import ungroup_name
from .spec import TensorSpec, dtype_from_name

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "dtype": "float32",
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "dtype": "float32",
    },
    "tiny-qwen3-tied": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "dtype": "float32",
    },
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32",
    },
    "tiny-mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32",
    },
    "llama-3-8b-shape": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    },
    # Real shapes (config numbers only) for planning and simulating at scale; weights are never built.
    "llama-3-70b-shape": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    },
    "qwen3-235b-a22b-shape": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
    },
    "deepseek-v3-shape": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "norm_topk_prob": True,
        "num_nextn_predict_layers": 1, "vocab_size": 129280, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
    },
    "kimi-k2-shape": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 2.827, "topk_method": "noaux_tc", "norm_topk_prob": True,
        "num_nextn_predict_layers": 0, "vocab_size": 163840, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
    },
    "qwen3-30b-a3b-shape": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
    },
}


def load_config(model: str) -> dict[str, Any]:
    """A preset name, a HF model directory, or a ``config.json`` path -> the config as a dict."""
    if model in PRESETS:
        return dict(PRESETS[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise RefitError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor a HF model directory / config.json")
    return json.loads(path.read_text())


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    return dtype_from_name(config.get("dtype") or config.get("torch_dtype") or "float32")


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for dense models)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    if not num_experts(config):
        return False
    step = config.get("decoder_sparse_step", 1) or 1
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def checkpoint_specs(config: dict[str, Any], *, grouped: bool = True) -> list[TensorSpec]:
    """The HF checkpoint tensors of a decoder-only model, in checkpoint order.

    With ``grouped`` (the default) per-expert tensors are returned as stacked logical tensors
    (``...experts.gate_proj.weight`` of shape ``[E, I, H]``); otherwise one spec per expert.
    """
    arch = (config.get("architectures") or ["?"])[0]
    known = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "MixtralForCausalLM", "MistralForCausalLM"}
    if arch not in known:
        raise RefitError(f"architecture {arch!r} is not known from config alone (known: {sorted(known)})")
    dtype = config_dtype(config)
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = head_dim(config)
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], hidden), dtype)]
    experts = num_experts(config)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype))
        for proj, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
            specs.append(TensorSpec(f"{p}.self_attn.{proj}.weight", (rows, hidden), dtype))
            if arch == "Qwen2ForCausalLM":
                specs.append(TensorSpec(f"{p}.self_attn.{proj}.bias", (rows,), dtype))
        specs.append(TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, heads * hd), dtype))
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            specs.append(TensorSpec(f"{p}.self_attn.q_norm.weight", (hd,), dtype))
            specs.append(TensorSpec(f"{p}.self_attn.k_norm.weight", (hd,), dtype))
        specs.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype))
        if _is_moe_layer(config, layer):
            specs.extend(_moe_specs(config, arch, p, experts, hidden, dtype, grouped))
        else:
            inter = config["intermediate_size"]
            specs.append(TensorSpec(f"{p}.mlp.gate_proj.weight", (inter, hidden), dtype))
            specs.append(TensorSpec(f"{p}.mlp.up_proj.weight", (inter, hidden), dtype))
            specs.append(TensorSpec(f"{p}.mlp.down_proj.weight", (hidden, inter), dtype))
    specs.append(TensorSpec("model.norm.weight", (hidden,), dtype))
    if not config.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], hidden), dtype))
    return specs


def _moe_specs(config: dict, arch: str, prefix: str, experts: int, hidden: int, dtype: torch.dtype,
               grouped: bool) -> list[TensorSpec]:
    if arch == "MixtralForCausalLM":
        inter = config["intermediate_size"]
        block = f"{prefix}.block_sparse_moe"
        projs = (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden)))
    else:
        inter = config["moe_intermediate_size"]
        block = f"{prefix}.mlp"
        projs = (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))
    specs = [TensorSpec(f"{block}.gate.weight", (experts, hidden), dtype)]
    if grouped:
        specs += [TensorSpec(f"{block}.experts.{proj}.weight", (experts, *shape), dtype) for proj, shape in projs]
    else:
        specs += [TensorSpec(f"{block}.experts.{e}.{proj}.weight", shape, dtype)
                  for e in range(experts) for proj, shape in projs]
    return specs


def reference_tensor(spec: TensorSpec, seed: int, step: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Deterministic random weights for ``spec`` at training ``step``: the demo's and tests' ground truth.

    Norm weights are drawn around 1, everything else around 0 with std 0.05, so a model with these
    weights generates non-degenerate text. Identical on every process that asks.
    """
    salt = zlib.crc32(f"{spec.name}|{seed}|{step}".encode())
    gen = torch.Generator(device="cpu").manual_seed(salt)
    values = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if "norm" in spec.name.rsplit(".", 2)[-2]:
        values = 1.0 + 0.1 * values
    else:
        values = 0.05 * values
    return values.to(device=device, dtype=spec.dtype)


def reference_state_dict(config: dict[str, Any], seed: int, step: int, *, grouped: bool = False,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full HF state dict of a preset's weights at ``step`` (per-expert names unless ``grouped``)."""
    out: dict[str, torch.Tensor] = {}
    for spec in checkpoint_specs(config, grouped=True):
        tensor = reference_tensor(spec, seed, step)
        if dtype is not None:
            tensor = tensor.to(dtype)
        if grouped or ".experts." not in spec.name:
            out[spec.name] = tensor
        else:
            for e in range(tensor.shape[0]):
                out[ungroup_name(spec.name, e)] = tensor[e]
    return out
