"""Model presets, the checkpoint inventory of a model, and the demo's deterministic reference weights.

A model is a preset name, a HF model directory or a ``config.json``. Its inventory (HF tensor
names, shapes, dtypes) comes from the directory's safetensors headers when it has weights, else
from its config through ``transformers`` (meta device), else from refit's hand-written table
(:mod:`refit_core.kit.inventory`). Metadata-only layouts (``refit plan``) and the demo's reference
weights are built on it, so no model has to be instantiated.
"""

from __future__ import annotations

import functools
import json
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import default_expert_name
from refit_core.contract.spec import TensorSpec
from refit_core.kit.inventory import (
    InventorySource,
    config_dtype,
    config_specs,
    group_specs,
    head_dim,
    num_experts,
    safetensors_specs,
)

__all__ = [
    "PRESETS", "InventorySource", "ModelInventory", "checkpoint_specs", "config_dtype", "head_dim", "load_config",
    "model_inventory", "num_experts", "reference_state_dict", "reference_tensor",
]

_TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "dtype": "float32",
}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
_LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "dtype": "bfloat16",
}
_QWEN3_235B_A22B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
}
_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "vocab_size": 129280, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": _TINY_LLAMA,
    "tiny-qwen3": {**_TINY_LLAMA, **_QWEN3},
    "tiny-qwen3-tied": {**_TINY_LLAMA, **_QWEN3, "tie_word_embeddings": True},
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
    "llama-3-8b-shape": _LLAMA_3_8B,
    # Real shapes (config numbers only) for planning and simulating at scale; weights are never built.
    "llama-3-70b-shape": {**_LLAMA_3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                          "num_attention_heads": 64},
    "qwen3-235b-a22b-shape": _QWEN3_235B_A22B,
    "deepseek-v3-shape": _DEEPSEEK_V3,
    "kimi-k2-shape": {
        **_DEEPSEEK_V3, "first_k_dense_replace": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
        "num_nextn_predict_layers": 0, "vocab_size": 163840, "max_position_embeddings": 131072, "rope_theta": 50000.0,
    },
    "qwen3-30b-a3b-shape": {
        **_QWEN3_235B_A22B, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "max_position_embeddings": 32768,
    },
}
"""Model configs by name: tiny ones for tests and the demo, real shapes (``-shape``) for planning at scale.
Presets of one family are the family's base with the keys that differ."""


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


@dataclass(frozen=True)
class ModelInventory:
    """A model's config and its HF checkpoint tensors (per-expert names), and where they came from."""

    model: str
    config: dict[str, Any]
    specs: tuple[TensorSpec, ...]
    source: InventorySource

    def grouped(self) -> list[TensorSpec]:
        """The specs with per-expert tensors stacked into grouped ``[E, ...]`` tensors."""
        return group_specs(self.specs)

    def describe(self) -> str:
        total = sum(s.nbytes for s in self.specs)
        return f"{len(self.specs)} tensors, {total / 2**20:.1f} MiB, from {self.source.value}"


def model_inventory(model: str) -> ModelInventory:
    """The inventory of a preset, a HF model directory (its safetensors headers when it has any)
    or a ``config.json``."""
    config = load_config(model)
    if model not in PRESETS and Path(model).is_dir():
        specs = safetensors_specs(model)
        if specs is not None:
            return ModelInventory(model, config, tuple(specs), InventorySource.SAFETENSORS)
    specs, source = config_specs(config)
    return ModelInventory(model, config, tuple(specs), source)


def checkpoint_specs(config: dict[str, Any], *, grouped: bool = True) -> list[TensorSpec]:
    """The HF checkpoint tensors of a decoder model's config, in a stable natural order.

    With ``grouped`` (the default) per-expert tensors are returned as stacked logical tensors
    (``...experts.gate_proj.weight`` of shape ``[E, I, H]``); otherwise one spec per expert.
    """
    return list(_checkpoint_specs(json.dumps(config, sort_keys=True), grouped))


@functools.lru_cache(maxsize=16)
def _checkpoint_specs(config_json: str, grouped: bool) -> tuple[TensorSpec, ...]:
    """Cached per config: ``refit plan`` asks once per rank, and grouping 18k experts is not free."""
    specs, _ = config_specs(json.loads(config_json))
    return tuple(group_specs(specs) if grouped else specs)


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


def reference_state_dict(model: dict[str, Any] | Sequence[TensorSpec], seed: int, step: int, *,
                         grouped: bool = False, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full HF state dict of the reference weights at ``step`` (per-expert names unless ``grouped``).

    ``model`` is a config (its inventory: :func:`checkpoint_specs`) or an inventory's specs
    (:attr:`ModelInventory.specs`, per-expert or grouped). Experts are drawn as one grouped
    tensor each, so both forms give the same values.
    """
    per_expert = config_specs(model)[0] if isinstance(model, dict) else list(model)
    members: dict[str, dict[int, str]] = defaultdict(dict)
    for spec in per_expert:
        expert = default_expert_name(spec.name)
        if expert is not None:
            members[expert.group][expert.index] = spec.name
    out: dict[str, torch.Tensor] = {}
    for spec in group_specs(per_expert):
        tensor = reference_tensor(spec, seed, step)
        if dtype is not None:
            tensor = tensor.to(dtype)
        if grouped or spec.name not in members:
            out[spec.name] = tensor
        else:
            for index, name in sorted(members[spec.name].items()):
                out[name] = tensor[index]
    return out
