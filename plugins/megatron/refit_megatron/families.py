"""The HF mapping, one small declarative table per architecture family.

A table maps megatron-core parameter names to HF checkpoint names and says how the parameter holds
them (:class:`Kind`). Names are relative: layer rules to ``decoder.layers.{i}.`` (HF side
``model.layers.{layer}.``), expert rules to the layer's experts module, top rules to the model.
``{e}`` in a HF name is the global expert index, ``{i}`` in a megatron name the local one.
Rules marked ``te`` are Transformer Engine spellings of the same tensors (fused layer norms,
``TEGroupedMLP``'s ``weight{i}``); ``tp_dim`` is where the local spec splits a parameter under
tensor parallelism (the live path reads it from the parameter itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from refit_core import PluginError

from .hybrid import ATTENTION as HYBRID_ATTENTION
from .hybrid import MAMBA, MLP, MOE, hybrid_pattern


class Kind(Enum):
    """How one megatron parameter holds HF tensors."""

    COPY = "copy"
    """The parameter is the HF tensor, whole or split on ``tp_dim``."""
    QKV = "qkv"
    """Fused q/k/v rows grouped per query group ``[q.. k v | q.. k v]``; TP splits rows contiguously."""
    GLU = "glu"
    """``[gate; up]`` rows; TP rank r holds ``[gate_r; up_r]`` (partition stride 2)."""
    VOCAB = "vocab"
    """Vocabulary rows padded past the HF vocabulary, split over TP on dim 0; only real rows are sent."""
    GROUPED_GLU = "grouped_glu"
    """Legacy ``GroupedMLP.weight1``: ``view(E_local, hidden, 2 * ffn / etp)``, all local experts."""
    GROUPED_DOWN = "grouped_down"
    """Legacy ``GroupedMLP.weight2``: ``view(E_local, ffn / etp, hidden)``, all local experts."""
    MAMBA_IN_PROJ = "mamba_in_proj"
    """``MambaMixer.in_proj``: rows ``[z; x; B; C; dt]``, each section split over TP on its own, so
    TP rank r holds ``[z_r; x_r; B_r; C_r; dt_r]`` (not a plain row split of the HF tensor)."""
    MAMBA_CONV = "mamba_conv"
    """``MambaMixer.conv1d`` weight / bias: channels ``[x; B; C]``, each section split over TP on its own."""


@dataclass(frozen=True)
class Rule:
    """One megatron parameter (or buffer) and the HF tensor(s) it holds."""

    kind: Kind
    hf: tuple[str, ...]
    tp_dim: int | None = None
    te: bool = False
    buffer: bool = False


def copy(hf: str, tp_dim: int | None = None, *, te: bool = False, buffer: bool = False) -> Rule:
    return Rule(Kind.COPY, (hf,), tp_dim, te, buffer)


def glu(gate: str, up: str, *, te: bool = False) -> Rule:
    return Rule(Kind.GLU, (gate, up), 0, te)


def qkv(q: str, k: str, v: str) -> Rule:
    return Rule(Kind.QKV, (q, k, v), 0)


ATTENTION = {
    "input_layernorm.weight": copy("input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_weight": copy("input_layernorm.weight", te=True),
    "self_attention.linear_qkv.weight": qkv(*(f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.linear_qkv.bias": qkv(*(f"self_attn.{p}_proj.bias" for p in "qkv")),
    "self_attention.q_layernorm.weight": copy("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": copy("self_attn.k_norm.weight"),
    "self_attention.linear_proj.weight": copy("self_attn.o_proj.weight", 1),
}

MLA_ATTENTION = {
    "input_layernorm.weight": copy("input_layernorm.weight"),
    "self_attention.linear_q_proj.weight": copy("self_attn.q_proj.weight", 0),
    # the local spec splits the down projections like any column-parallel linear; TE duplicates them
    "self_attention.linear_q_down_proj.weight": copy("self_attn.q_a_proj.weight", 0),
    "self_attention.q_layernorm.weight": copy("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.layer_norm_weight": copy("self_attn.q_a_layernorm.weight", te=True),
    "self_attention.linear_q_up_proj.weight": copy("self_attn.q_b_proj.weight", 0),
    "self_attention.linear_kv_down_proj.weight": copy("self_attn.kv_a_proj_with_mqa.weight", 0),
    "self_attention.kv_layernorm.weight": copy("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.layer_norm_weight": copy("self_attn.kv_a_layernorm.weight", te=True),
    "self_attention.linear_kv_up_proj.weight": copy("self_attn.kv_b_proj.weight", 0),
    "self_attention.linear_proj.weight": copy("self_attn.o_proj.weight", 1),
}

DENSE_MLP = {
    "pre_mlp_layernorm.weight": copy("post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_weight": copy("post_attention_layernorm.weight", te=True),
    "mlp.linear_fc1.weight": glu("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": copy("mlp.down_proj.weight", 1),
}


def moe_block(block: str, gate: str, up: str, down: str) -> dict[str, Rule]:
    """A MoE layer's router and experts (all three megatron expert layouts), ``block`` the HF module."""
    e = f"{block}.experts.{{e}}"
    return {
        "pre_mlp_layernorm.weight": copy("post_attention_layernorm.weight"),
        "mlp.router.weight": copy(f"{block}.gate.weight"),
        "mlp.experts.local_experts.{i}.linear_fc1.weight": glu(f"{e}.{gate}.weight", f"{e}.{up}.weight"),
        "mlp.experts.local_experts.{i}.linear_fc2.weight": copy(f"{e}.{down}.weight", 1),
        "mlp.experts.linear_fc1.weight{i}": glu(f"{e}.{gate}.weight", f"{e}.{up}.weight", te=True),
        "mlp.experts.linear_fc2.weight{i}": copy(f"{e}.{down}.weight", 1, te=True),
        "mlp.experts.weight1": Rule(Kind.GROUPED_GLU, (f"{block}.experts.{gate}.weight",
                                                       f"{block}.experts.{up}.weight"), 1),
        "mlp.experts.weight2": Rule(Kind.GROUPED_DOWN, (f"{block}.experts.{down}.weight",), 0),
    }


SHARED_EXPERTS = {  # DeepSeek-V3
    "mlp.shared_experts.linear_fc1.weight": glu("mlp.shared_experts.gate_proj.weight",
                                                "mlp.shared_experts.up_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": copy("mlp.shared_experts.down_proj.weight", 1),
    "mlp.router.expert_bias": copy("mlp.gate.e_score_correction_bias", buffer=True),
}

SHARED_EXPERT_WITH_GATE = {  # Qwen2-MoE
    "mlp.shared_experts.linear_fc1.weight": glu("mlp.shared_expert.gate_proj.weight",
                                                "mlp.shared_expert.up_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": copy("mlp.shared_expert.down_proj.weight", 1),
    "mlp.shared_experts.gate_weight": copy("mlp.shared_expert_gate.weight"),
}

TOP = {
    "embedding.word_embeddings.weight": Rule(Kind.VOCAB, ("model.embed_tokens.weight",), 0),
    "decoder.final_layernorm.weight": copy("model.norm.weight"),
    "output_layer.weight": Rule(Kind.VOCAB, ("lm_head.weight",), 0),
}

MTP = {  # relative to mtp.layers.{k}. / model.layers.{num_hidden_layers + k}.
    "enorm.weight": copy("enorm.weight"),
    "hnorm.weight": copy("hnorm.weight"),
    "eh_proj.weight": copy("eh_proj.weight", 0),
    "final_layernorm.weight": copy("shared_head.norm.weight"),
}


@dataclass(frozen=True)
class Family:
    """An architecture family: its HF architectures, attention flavour and mapping tables.

    A hybrid family (``hybrid`` not empty, NemotronH) picks each layer's table by the layer's
    symbol in the config's pattern (:func:`~refit_megatron.hybrid.hybrid_pattern`) instead of
    ``dense`` / ``moe``. ``top`` maps the embedding, final norm and output layer; ``layer_prefix``
    is the HF name of the layer list.
    """

    name: str
    architectures: tuple[str, ...]
    dense: dict[str, Rule]
    moe: dict[str, Rule] = field(default_factory=dict)
    qk_norm: bool = False
    qkv_bias: bool = False
    mla: bool = False
    hybrid: dict[str, dict[str, Rule]] = field(default_factory=dict)
    top: dict[str, Rule] = field(default_factory=lambda: TOP)
    layer_prefix: str = "model.layers."

    def num_experts(self, config: dict[str, Any]) -> int:
        return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)

    def num_layers(self, config: dict[str, Any]) -> int:
        return len(hybrid_pattern(config)) if self.hybrid else int(config["num_hidden_layers"])

    def is_moe_layer(self, config: dict[str, Any], layer: int) -> bool:
        if self.hybrid:
            return hybrid_pattern(config)[layer] == MOE
        if not self.moe or not self.num_experts(config):
            return False
        if "first_k_dense_replace" in config:
            return layer >= config["first_k_dense_replace"] and layer % config.get("moe_layer_freq", 1) == 0
        step = config.get("decoder_sparse_step", 1) or 1
        return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0

    def moe_layer_pattern(self, config: dict[str, Any]) -> list[int]:
        """Megatron's ``moe_layer_freq`` list: 1 for a MoE layer, 0 for a dense one."""
        return [int(self.is_moe_layer(config, layer)) for layer in range(config["num_hidden_layers"])]

    def shared_expert_size(self, config: dict[str, Any]) -> int:
        if config.get("n_shared_experts"):
            return config["n_shared_experts"] * config["moe_intermediate_size"]
        return int(config.get("shared_expert_intermediate_size") or 0)

    def layer_rules(self, config: dict[str, Any], layer: int) -> dict[str, Rule]:
        if self.hybrid:
            return self.hybrid[hybrid_pattern(config)[layer]]
        return self.moe if self.is_moe_layer(config, layer) else self.dense


MAMBA_LAYER = {  # a NemotronH Mamba layer: the mixer and the layer's norm (TE fuses it into in_proj)
    "norm.weight": copy("norm.weight"),
    "mixer.in_proj.layer_norm_weight": copy("norm.weight", te=True),
    "mixer.in_proj.weight": Rule(Kind.MAMBA_IN_PROJ, ("mixer.in_proj.weight",), 0),
    "mixer.conv1d.weight": Rule(Kind.MAMBA_CONV, ("mixer.conv1d.weight",), 0),
    "mixer.conv1d.bias": Rule(Kind.MAMBA_CONV, ("mixer.conv1d.bias",), 0),
    "mixer.A_log": copy("mixer.A_log", 0),
    "mixer.D": copy("mixer.D", 0),
    "mixer.dt_bias": copy("mixer.dt_bias", 0),
    "mixer.norm.weight": copy("mixer.norm.weight", 0),  # gated RMSNorm, groups never straddle TP ranks
    "mixer.out_proj.weight": copy("mixer.out_proj.weight", 1),
}


NEMOTRON_H = {  # one table per layer symbol, names relative to decoder.layers.{i}. / backbone.layers.{i}.
    MAMBA: MAMBA_LAYER,
    HYBRID_ATTENTION: {
        "input_layernorm.weight": copy("norm.weight"),
        "self_attention.linear_qkv.layer_norm_weight": copy("norm.weight", te=True),
        "self_attention.linear_qkv.weight": qkv(*(f"mixer.{p}_proj.weight" for p in "qkv")),
        "self_attention.linear_proj.weight": copy("mixer.o_proj.weight", 1),
    },
    MLP: {  # squared-ReLU MLP, no gate: linear_fc1 is up_proj alone
        "pre_mlp_layernorm.weight": copy("norm.weight"),
        "mlp.linear_fc1.layer_norm_weight": copy("norm.weight", te=True),
        "mlp.linear_fc1.weight": copy("mixer.up_proj.weight", 0),
        "mlp.linear_fc2.weight": copy("mixer.down_proj.weight", 1),
    },
    MOE: {  # non-gated experts and shared experts, sigmoid router with expert bias
        "pre_mlp_layernorm.weight": copy("norm.weight"),
        "mlp.router.weight": copy("mixer.gate.weight"),
        "mlp.router.expert_bias": copy("mixer.gate.e_score_correction_bias", buffer=True),
        "mlp.experts.local_experts.{i}.linear_fc1.weight": copy("mixer.experts.{e}.up_proj.weight", 0),
        "mlp.experts.local_experts.{i}.linear_fc2.weight": copy("mixer.experts.{e}.down_proj.weight", 1),
        "mlp.experts.linear_fc1.weight{i}": copy("mixer.experts.{e}.up_proj.weight", 0, te=True),
        "mlp.experts.linear_fc2.weight{i}": copy("mixer.experts.{e}.down_proj.weight", 1, te=True),
        "mlp.shared_experts.linear_fc1.weight": copy("mixer.shared_experts.up_proj.weight", 0),
        "mlp.shared_experts.linear_fc2.weight": copy("mixer.shared_experts.down_proj.weight", 1),
    },
}

NEMOTRON_H_TOP = {  # megatron-core's MambaModel
    "embedding.word_embeddings.weight": Rule(Kind.VOCAB, ("backbone.embeddings.weight",), 0),
    "decoder.final_norm.weight": copy("backbone.norm_f.weight"),
    "output_layer.weight": Rule(Kind.VOCAB, ("lm_head.weight",), 0),
}

_QWEN3_MOE = {**ATTENTION, **moe_block("mlp", "gate_proj", "up_proj", "down_proj")}
_DEEPSEEK_DENSE = {**MLA_ATTENTION, **DENSE_MLP}

FAMILIES = [
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), {**ATTENTION, **DENSE_MLP}),
    Family("qwen2", ("Qwen2ForCausalLM",), {**ATTENTION, **DENSE_MLP}, qkv_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), {**ATTENTION, **DENSE_MLP}, qk_norm=True),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), {**ATTENTION, **DENSE_MLP}, _QWEN3_MOE, qk_norm=True),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), {**ATTENTION, **DENSE_MLP},
           {**_QWEN3_MOE, **SHARED_EXPERT_WITH_GATE}, qkv_bias=True),
    Family("mixtral", ("MixtralForCausalLM",), {**ATTENTION, **DENSE_MLP},
           {**ATTENTION, **moe_block("block_sparse_moe", "w1", "w3", "w2")}),
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), _DEEPSEEK_DENSE,
           {**MLA_ATTENTION, **moe_block("mlp", "gate_proj", "up_proj", "down_proj"), **SHARED_EXPERTS}, mla=True),
    Family("nemotron_h", ("NemotronHForCausalLM",), {}, hybrid=NEMOTRON_H, top=NEMOTRON_H_TOP,
           layer_prefix="backbone.layers."),
]


def family_of(config: dict[str, Any]) -> Family:
    """The family of a HF config (by ``architectures``), or a PluginError naming the known ones."""
    arch = (config.get("architectures") or ["?"])[0]
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    known = sorted(a for f in FAMILIES for a in f.architectures)
    raise PluginError(f"refit-plugin-megatron has no mapping for architecture {arch!r} (known: {known})")
