"""The megatron backend's conformance suite (entry point ``refit.conformance: megatron``).

Model-free part: dense, tied, MoE (Qwen3-MoE, Mixtral) and MLA (DeepSeek-V3, checkpoint listed by
:func:`refit_megatron.checkpoint.hf_specs`) models, 4 layers each so that PP x VPP splits evenly,
described from metadata in every layout family the plugin serves (TP, PP, VPP, EP, expert-TP, DP
and their combinations), planned against the kit's reference checkpoint; layouts megatron cannot
take are refused with ``PluginError``. ``refit check-plugin megatron`` runs this part (no
megatron-core needed).

Live part: the train factory builds a real megatron-core ``GPTModel`` (local spec, fp32, CPU) on
each rank over gloo, with megatron's own process groups (:func:`refit_megatron.build.init_parallel`),
and one round trip (TP2 Qwen3-MoE -> the reference engine) refits two steps bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from refit_core import Side
from refit_core.testing import Conformance, ModelCase, RankContext, Refusal, RoundTrip, TrainFactory

from .checkpoint import hf_specs

LAYERS = 4
"""Every model gets 4 layers, so that pp=2 x vpp=2 splits them evenly."""

MLA_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "head_dim": 64,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "vocab_size": 500, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "dtype": "float32",
}


def _preset(name: str, **overrides: Any) -> ModelCase:
    return ModelCase.preset(name, num_hidden_layers=LAYERS, **overrides)


MOE = _preset("tiny-qwen3-moe")
MODELS = (
    _preset("tiny-llama", vocab_size=500),  # Megatron pads the vocabulary: only real rows may travel
    _preset("tiny-qwen3"),
    _preset("tiny-qwen3-tied"),
    MOE,
    _preset("tiny-mixtral"),
    ModelCase("tiny-deepseek-v3", MLA_CONFIG, checkpoint=tuple(hf_specs(MLA_CONFIG).values())),
)
LAYOUTS = (
    "", "tp=2", "tp=4", "pp=2", "pp=2,vpp=2", "tp=2,pp=2", "dp=2", "dp=2,ep=2", "tp=2,ep=2",
    "tp=2,dp=2,ep=2", "tp=2,dp=2,ep=2,etp=2", "pp=2,dp=2,ep=2",
    "pp=2,pp_first=1,pp_last=3", "pp=3,pp_first=2",  # megatron's uneven pipeline: 1 + 3, 2 + 1 + 1
)


def build(ctx: RankContext) -> Any:
    """This rank's ``GPTModel`` chunks in ``ctx.layout`` (megatron's own groups over a gloo world)."""
    import torch.distributed as dist

    from .build import build_gpt, init_parallel
    from .source import MegatronSource

    dist.init_process_group("gloo", init_method=ctx.init_method, rank=ctx.rank, world_size=ctx.world_size)
    init_parallel(ctx.layout)
    config = dict(ctx.config)
    return MegatronSource(build_gpt(config, ctx.layout), config)


def load(model: Any, state: dict[str, torch.Tensor]) -> None:
    from .weights import load_hf_weights

    load_hf_weights(model, state)


def close(model: Any) -> None:
    import torch.distributed as dist

    from .build import destroy_parallel

    destroy_parallel()
    dist.destroy_process_group()


SUITE = Conformance(
    plugin="megatron",
    backend="megatron",
    models=MODELS,
    train_layouts=LAYOUTS,
    refusals=(
        Refusal(Side.TRAIN, "fsdp=2", "no fsdp degree"),
        Refusal(Side.TRAIN, "pp=3", "do not split evenly"),
        Refusal(Side.TRAIN, "pp=2,vpp=4", "do not split evenly"),
        Refusal(Side.TRAIN, "pp=2,pp_first=1,pp_last=1", "left for 0 middle"),
        Refusal(Side.TRAIN, "tp=2,ep=4", "must divide", MOE),
        Refusal(Side.TRAIN, "dp=3,ep=3", "do not split over ep", MOE),
    ),
    train=TrainFactory(build, load, close),
    round_trips=(RoundTrip(MOE, "tp=2", partner_layout=""),),
)
