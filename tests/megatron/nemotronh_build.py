"""A NemotronH megatron-core ``MambaModel`` built on CPU, and the test's own conversion of its weights to HF.

mamba_ssm and causal_conv1d are CUDA-only, so megatron-core's ``MambaMixer`` cannot run here. It can
be *built*: its ``__init__`` creates ``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm`` and
``out_proj`` with megatron's own names, shapes and TP sharding and needs only two kernel names
replaced (:func:`patch_mamba_for_cpu`): the ``HAVE_MAMBA_SSM`` flag, and ``ExtendedRMSNorm`` (mamba_ssm's
Triton gated RMSNorm), stood in for by :class:`StandInGatedNorm`, a plain module holding the same
``weight`` and stating the same sharding. The rest is megatron-core as it is: ``MambaModel``,
``MambaStack`` (layers from the hybrid pattern, PP splits), attention, MLP and MoE layers of the
local spec; ``TENorm`` (the final norm, Transformer Engine only) becomes the local RMSNorm.

The reference is independent of refit_megatron: megatron's own ``sharded_state_dict()`` (which
splits ``in_proj`` into ``z, x, B, C, dt`` and ``conv1d`` into ``x, B, C`` sections, each with its
global offset) is assembled and converted to HF names by :func:`nemotron_to_hf`, written here.
"""

from __future__ import annotations

from typing import Any

import torch

from refit_core import ParallelLayout

CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 128,
    "hybrid_override_pattern": "M-M*ME", "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "mamba_num_heads": 8,
    "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "vocab_size": 500,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "n_shared_experts": 1, "tie_word_embeddings": False,
    "layer_norm_epsilon": 1e-5, "dtype": "float32",
}
"""Every layer kind (Mamba, MLP, attention, MoE); 8 Mamba heads in 2 groups, so TP 2 splits each
of z, x, B, C and dt; vocabulary 500 (megatron pads it to 512 at TP <= 4)."""


class StandInGatedNorm(torch.nn.Module):
    """Stands in for mamba_ssm's ``RMSNormGated`` (megatron's ``ExtendedRMSNorm``): the same ``weight``
    ``[d_inner / TP]``, the same sharded state (split on dim 0); no forward (its kernel is Triton)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.group_size = group_size

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def patch_mamba_for_cpu() -> None:
    """Let megatron-core's ``MambaMixer`` and ``MambaStack`` build without mamba_ssm or Transformer Engine."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm import mamba_block, mamba_mixer
    from refit_megatron.cpu_patches import patch_for_cpu

    patch_for_cpu()
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.ExtendedRMSNorm = StandInGatedNorm
    mamba_block.TENorm = LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False)


def build_mamba(config: dict[str, Any], layout: ParallelLayout, seed: int = 1234) -> Any:
    """This rank's megatron-core ``MambaModel`` for a NemotronH config (call ``init_parallel`` first)."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mamba import MambaModel
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    from refit_megatron import padded_vocab

    patch_mamba_for_cpu()
    cfg = TransformerConfig(
        num_layers=len(config["hybrid_override_pattern"]), hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], num_query_groups=config["num_key_value_heads"],
        kv_channels=config["head_dim"], ffn_hidden_size=config["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=config["layer_norm_epsilon"], gated_linear_unit=False, activation_func=F.relu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, use_cpu_initialization=True, perform_initialization=True,
        persist_layer_norm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        mamba_state_dim=config["ssm_state_size"], mamba_head_dim=config["mamba_head_dim"],
        mamba_num_groups=config["n_groups"], mamba_num_heads=config["mamba_num_heads"],
        num_moe_experts=config["n_routed_experts"], moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=config["moe_shared_expert_intermediate_size"],
        moe_router_topk=config["num_experts_per_tok"], moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
    )
    norm = LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False)
    attention = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    spec = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm, mamba_bda=get_bias_dropout_add,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)))),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=attention.self_attention, self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp_bda=get_bias_dropout_add,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)))),
        moe_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(  # no attention
            pre_mlp_layernorm=norm, mlp_bda=get_bias_dropout_add,
            mlp=get_gpt_layer_local_spec(num_experts=config["n_routed_experts"],
                                         normalization="RMSNorm").submodules.mlp)),
    ))
    torch.manual_seed(seed)
    from megatron.core import parallel_state as ps

    return MambaModel(cfg, spec, vocab_size=padded_vocab(config["vocab_size"], layout.tp),
                      max_sequence_length=256, hybrid_override_pattern=config["hybrid_override_pattern"],
                      pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                      position_embedding_type="none",
                      share_embeddings_and_output_weights=bool(config["tie_word_embeddings"]))


# -- the independent reference ------------------------------------------------------------------

SECTIONS = {"in_proj.weight": ("z", "x", "B", "C", "dt"), "conv1d.weight": ("x", "B", "C"),
            "conv1d.bias": ("x", "B", "C")}
"""HF NemotronH keeps megatron's section order: ``in_proj`` rows ``[z; x; B; C; dt]`` (transformers
splits them as gate, xBC, dt), ``conv1d`` channels ``[x; B; C]``."""


def nemotron_to_hf(mg: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Megatron-global tensors (``sharded_state_dict`` keys, sections as megatron names them) -> HF."""
    vocab = config["vocab_size"]
    top = {"embedding.word_embeddings.weight": "backbone.embeddings.weight",
           "decoder.final_norm.weight": "backbone.norm_f.weight", "output_layer.weight": "lm_head.weight"}
    layer_names = {
        "norm.weight": "norm.weight", "input_layernorm.weight": "norm.weight",
        "pre_mlp_layernorm.weight": "norm.weight", "mixer.A_log": "mixer.A_log", "mixer.D": "mixer.D",
        "mixer.dt_bias": "mixer.dt_bias", "mixer.norm.weight": "mixer.norm.weight",
        "mixer.out_proj.weight": "mixer.out_proj.weight", "self_attention.linear_proj.weight": "mixer.o_proj.weight",
        "mlp.linear_fc1.weight": "mixer.up_proj.weight", "mlp.linear_fc2.weight": "mixer.down_proj.weight",
        "mlp.router.weight": "mixer.gate.weight", "mlp.router.expert_bias": "mixer.gate.e_score_correction_bias",
        "mlp.shared_experts.linear_fc1.weight": "mixer.shared_experts.up_proj.weight",
        "mlp.shared_experts.linear_fc2.weight": "mixer.shared_experts.down_proj.weight",
    }
    hf: dict[str, torch.Tensor] = {}
    for key, tensor in mg.items():
        if key in top:
            hf[top[key]] = tensor[:vocab] if "word_embeddings" in key or "output_layer" in key else tensor
            continue
        parts = key.split(".")
        assert parts[:2] == ["decoder", "layers"], key
        p, rest = f"backbone.layers.{parts[2]}", ".".join(parts[3:])
        if rest in layer_names:
            hf[f"{p}.{layer_names[rest]}"] = tensor
        elif rest == "self_attention.linear_qkv.weight":
            heads, groups, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
            q, k, v = tensor.reshape(groups, (heads // groups + 2) * d, -1).split([heads // groups * d, d, d], dim=1)
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                hf[f"{p}.mixer.{name}.weight"] = t.reshape(-1, tensor.shape[-1])
        elif rest.startswith("mlp.experts.experts.linear_fc"):
            proj = "up_proj" if "fc1" in rest else "down_proj"
            for e in range(tensor.shape[0]):
                hf[f"{p}.mixer.experts.{e}.{proj}.weight"] = tensor[e]
        elif not any(rest.startswith(f"mixer.{name}.") for name in SECTIONS):
            raise AssertionError(f"the test's converter does not know {key}")
    for key in mg:  # fused Mamba tensors: megatron's sections, concatenated in HF order
        parts = key.split(".")
        for name, order in SECTIONS.items():
            if ".".join(parts[3:]) == f"mixer.{name}.{order[0]}":
                stem = key.rsplit(".", 1)[0]
                hf[f"backbone.layers.{parts[2]}.mixer.{name}"] = torch.cat([mg[f"{stem}.{s}"] for s in order])
    return {k: v.contiguous() for k, v in hf.items()}
