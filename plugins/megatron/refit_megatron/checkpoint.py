"""HF checkpoint inventories (names and shapes) of the families the core does not list itself.

``hf_specs(config)`` lists per-expert checkpoint tensors; the core's ``checkpoint_specs`` covers
Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral, this module adds Qwen2-MoE, DeepSeek-V3 (MLA with
or without q-LoRA, shared experts, the router's score-correction bias, MTP layers) and NemotronH
(hybrid Mamba / attention / MLP / MoE layers under ``backbone.``; the tests check it against
transformers' own inventory).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from refit_core import PluginError, SourcePiece, TensorSpec
from refit_core.kit import checkpoint_specs, config_dtype

from .families import family_of
from .hybrid import ATTENTION, MAMBA, MLP, hybrid_pattern, mamba_setting


def in_checkpoint_order(config: dict[str, Any], pieces: list[SourcePiece]) -> list[SourcePiece]:
    """``pieces`` sorted by their tensor's place in :func:`hf_specs` (the inventory's order), then by box offsets.

    The live path walks megatron's modules (whose registration order is not the family table's:
    ``linear_proj`` comes before ``linear_qkv``), the metadata path walks the table; both answer in
    this one order, so that ``refit plan``'s schedule (and its fingerprint) is the live one. Names
    outside the per-expert inventory (legacy ``GroupedMLP``'s stacked experts) keep their order, last.
    """
    try:
        order = _order(json.dumps(config, sort_keys=True))
    except (TypeError, ValueError):  # a config dict that is not JSON (a torch.dtype value): offsets only
        order = {}
    last = len(order)
    return sorted(pieces, key=lambda p: (order.get(p.spec.name, last), p.box.offsets))


def hf_specs(config: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of the HF checkpoint of ``config`` (per-expert names), by name."""
    return _specs(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _order(config_json: str) -> dict[str, int]:
    """Each checkpoint name's place in :func:`hf_specs`, once per config (``refit plan`` sorts every rank)."""
    return {name: i for i, name in enumerate(_specs(config_json))}


@functools.lru_cache(maxsize=8)
def _specs(config_json: str) -> dict[str, TensorSpec]:
    """:func:`hf_specs`, computed once per config (``refit plan`` asks for every rank)."""
    config = json.loads(config_json)
    family = family_of(config)
    if family.name == "deepseek_v3":
        specs = _deepseek_v3(config)
    elif family.name == "qwen2_moe":
        specs = _qwen2_moe(config)
    elif family.name == "nemotron_h":
        specs = _nemotron_h(config)
    else:
        specs = checkpoint_specs(config, grouped=False)
    return {s.name: s for s in specs}


def _attention_mla(config: dict[str, Any], p: str, dtype: torch.dtype) -> list[TensorSpec]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_rank, q_rank = config["kv_lora_rank"], config.get("q_lora_rank")
    out = [TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype)]
    if q_rank:
        out += [TensorSpec(f"{p}.self_attn.q_a_proj.weight", (q_rank, hidden), dtype),
                TensorSpec(f"{p}.self_attn.q_a_layernorm.weight", (q_rank,), dtype),
                TensorSpec(f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), dtype)]
    else:
        out.append(TensorSpec(f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), hidden), dtype))
    out += [TensorSpec(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden), dtype),
            TensorSpec(f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,), dtype),
            TensorSpec(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank), dtype),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, heads * v), dtype),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype)]
    return out


def _mlp(prefix: str, inter: int, hidden: int, dtype: torch.dtype) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.gate_proj.weight", (inter, hidden), dtype),
            TensorSpec(f"{prefix}.up_proj.weight", (inter, hidden), dtype),
            TensorSpec(f"{prefix}.down_proj.weight", (hidden, inter), dtype)]


def _deepseek_v3(config: dict[str, Any]) -> list[TensorSpec]:
    dtype = config_dtype(config)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    family = family_of(config)
    experts, moe_inter = config["n_routed_experts"], config["moe_intermediate_size"]
    layers = config["num_hidden_layers"]
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for layer in range(layers + int(config.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{layer}"
        if layer >= layers:
            specs += [TensorSpec(f"{p}.enorm.weight", (hidden,), dtype),
                      TensorSpec(f"{p}.hnorm.weight", (hidden,), dtype),
                      TensorSpec(f"{p}.eh_proj.weight", (hidden, 2 * hidden), dtype),
                      TensorSpec(f"{p}.shared_head.norm.weight", (hidden,), dtype)]
        specs += _attention_mla(config, p, dtype)
        if family.is_moe_layer(config, layer):
            specs += [TensorSpec(f"{p}.mlp.gate.weight", (experts, hidden), dtype),
                      TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (experts,), torch.float32)]
            for e in range(experts):
                specs += _mlp(f"{p}.mlp.experts.{e}", moe_inter, hidden, dtype)
            specs += _mlp(f"{p}.mlp.shared_experts", family.shared_expert_size(config), hidden, dtype)
        else:
            specs += _mlp(f"{p}.mlp", config["intermediate_size"], hidden, dtype)
    specs.append(TensorSpec("model.norm.weight", (hidden,), dtype))
    if not config.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (vocab, hidden), dtype))
    return specs


def _qwen2_moe(config: dict[str, Any]) -> list[TensorSpec]:
    dense = dict(config, architectures=["Qwen2ForCausalLM"])
    dtype = config_dtype(config)
    hidden = config["hidden_size"]
    family = family_of(config)
    specs = []
    for spec in checkpoint_specs(dense, grouped=False):
        name = spec.name
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and ".mlp." in name and family.is_moe_layer(config, layer):
            if name.endswith("mlp.gate_proj.weight"):
                p = name.removesuffix(".mlp.gate_proj.weight")
                experts = family.num_experts(config)
                specs.append(TensorSpec(f"{p}.mlp.gate.weight", (experts, hidden), dtype))
                for e in range(experts):
                    specs += _mlp(f"{p}.mlp.experts.{e}", config["moe_intermediate_size"], hidden, dtype)
                specs += _mlp(f"{p}.mlp.shared_expert", config["shared_expert_intermediate_size"], hidden, dtype)
                specs.append(TensorSpec(f"{p}.mlp.shared_expert_gate.weight", (1, hidden), dtype))
            continue
        specs.append(spec)
    return specs


def _nemotron_h(config: dict[str, Any]) -> list[TensorSpec]:
    """NemotronH's checkpoint: ``backbone.embeddings``, one mixer per pattern symbol, ``backbone.norm_f``."""
    unsupported = [k for k in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias", "moe_latent_size")
                   if config.get(k)]
    if unsupported:
        raise PluginError(f"NemotronH with {unsupported} is not mapped by refit-plugin-megatron "
                          "(megatron-core's MambaMixer has no biases; latent MoE projections are not mapped)")
    dtype = config_dtype(config)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    m_heads = config["mamba_num_heads"]
    inner, bc = m_heads * config["mamba_head_dim"], mamba_setting(config, "n_groups") * config["ssm_state_size"]
    conv = inner + 2 * bc
    specs = [TensorSpec("backbone.embeddings.weight", (vocab, hidden), dtype)]
    for layer, symbol in enumerate(hybrid_pattern(config)):
        p = f"backbone.layers.{layer}"
        specs.append(TensorSpec(f"{p}.norm.weight", (hidden,), dtype))
        m = f"{p}.mixer"
        if symbol == MAMBA:
            specs += [TensorSpec(f"{m}.in_proj.weight", (2 * inner + 2 * bc + m_heads, hidden), dtype),
                      TensorSpec(f"{m}.conv1d.weight", (conv, 1, mamba_setting(config, "conv_kernel", 4)), dtype)]
            if mamba_setting(config, "use_conv_bias", True):
                specs.append(TensorSpec(f"{m}.conv1d.bias", (conv,), dtype))
            specs += [TensorSpec(f"{m}.{n}", (m_heads,), dtype) for n in ("A_log", "D", "dt_bias")]
            specs += [TensorSpec(f"{m}.norm.weight", (inner,), dtype),
                      TensorSpec(f"{m}.out_proj.weight", (hidden, inner), dtype)]
        elif symbol == ATTENTION:
            specs += [TensorSpec(f"{m}.q_proj.weight", (heads * head_dim, hidden), dtype),
                      TensorSpec(f"{m}.k_proj.weight", (kv * head_dim, hidden), dtype),
                      TensorSpec(f"{m}.v_proj.weight", (kv * head_dim, hidden), dtype),
                      TensorSpec(f"{m}.o_proj.weight", (hidden, heads * head_dim), dtype)]
        elif symbol == MLP:
            specs += _up_down(m, config["intermediate_size"], hidden, dtype)
        else:  # MoE
            experts = config["n_routed_experts"]
            specs += [TensorSpec(f"{m}.gate.weight", (experts, hidden), dtype),
                      TensorSpec(f"{m}.gate.e_score_correction_bias", (experts,), torch.float32)]
            for e in range(experts):
                specs += _up_down(f"{m}.experts.{e}", config["moe_intermediate_size"], hidden, dtype)
            specs += _up_down(f"{m}.shared_experts", config["moe_shared_expert_intermediate_size"], hidden, dtype)
    specs.append(TensorSpec("backbone.norm_f.weight", (hidden,), dtype))
    if not config.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (vocab, hidden), dtype))
    return specs


def _up_down(prefix: str, inter: int, hidden: int, dtype: torch.dtype) -> list[TensorSpec]:
    """A squared-ReLU MLP without a gate (NemotronH's MLP layers, experts and shared experts)."""
    return [TensorSpec(f"{prefix}.up_proj.weight", (inter, hidden), dtype),
            TensorSpec(f"{prefix}.down_proj.weight", (hidden, inter), dtype)]
