"""Build a megatron-core ``GPTModel`` from a HF ``config.json`` dict (demo, tests, benchmark).

A trainer builds its own model; this module is what refit's demo, tests and GPU benchmark use to
get one without a checkpoint: random weights, the local (non Transformer Engine) layer spec,
megatron-core's own process groups over an already initialized ``torch.distributed``.
On CPU it applies the workarounds megatron-core 0.16 needs (``cpu_patches``), documented there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from refit_core import ParallelLayout, PluginError
from refit_core.kit import config_dtype

from .families import family_of

VOCAB_DIVISIBLE_BY = 128
"""Megatron's default ``make_vocab_size_divisible_by``: the vocabulary is padded to a multiple of
this times the tensor-parallel size (megatron-core does no padding itself; its callers do)."""


def padded_vocab(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The vocabulary size Megatron-LM's trainers build with for ``vocab`` real tokens."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


@dataclass(frozen=True)
class BuildOptions:
    """How the model is built: ``grouped_gemm`` picks legacy ``GroupedMLP`` experts instead of
    ``SequentialMLP``; ``device`` ``"cpu"`` builds with ``use_cpu_initialization``, ``"cuda"`` on
    the current GPU, ``"meta"`` allocates nothing."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    grouped_gemm: bool = False
    seed: int = 1234


def init_parallel(layout: ParallelLayout) -> None:
    """megatron-core's process groups for ``layout`` over the default process group (tp-cp-ep-dp-pp)."""
    from megatron.core import parallel_state as ps

    if layout.fsdp != 1:
        raise PluginError("megatron layouts have no fsdp degree; use dp")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def transformer_config(config: dict[str, Any], layout: ParallelLayout, options: BuildOptions) -> Any:
    """megatron-core's ``TransformerConfig`` (or ``MLATransformerConfig``) for a HF config."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    family = family_of(config)
    dtype = options.dtype
    kwargs: dict[str, Any] = dict(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        ffn_hidden_size=config["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=family.qkv_bias, qk_layernorm=family.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.pp_first or None,
        num_layers_in_last_pipeline_stage=layout.pp_last or None,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        use_cpu_initialization=options.device != "cuda", perform_initialization=options.device != "meta",
        persist_layer_norm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        init_method_std=0.02,
    )
    if not family.mla:
        kwargs["num_query_groups"] = config.get("num_key_value_heads", config["num_attention_heads"])
        kwargs["kv_channels"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    experts = family.num_experts(config)
    if experts:
        kwargs.update(
            num_moe_experts=experts, moe_ffn_hidden_size=config["moe_intermediate_size"]
            if "moe_intermediate_size" in config else config["intermediate_size"],
            moe_router_topk=config.get("num_experts_per_tok", 2), moe_grouped_gemm=options.grouped_gemm,
            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_layer_freq=family.moe_layer_pattern(config),
            moe_router_pre_softmax=family.name == "mixtral",
        )
        if options.grouped_gemm:
            kwargs["moe_use_legacy_grouped_gemm"] = True
        shared = family.shared_expert_size(config)
        if shared:
            kwargs["moe_shared_expert_intermediate_size"] = shared
    if family.mla:
        kwargs.update(
            q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
            qk_head_dim=config["qk_nope_head_dim"], qk_pos_emb_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"], rope_type="rope", rotary_base=config.get("rope_theta", 10000.0),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_dtype="fp32",
        )
        if config.get("num_nextn_predict_layers"):
            kwargs["mtp_num_layers"] = config["num_nextn_predict_layers"]
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def build_gpt(config: dict[str, Any], layout: ParallelLayout, options: BuildOptions | None = None) -> list[Any]:
    """This rank's model chunks (one per virtual pipeline stage) of a HF config, random weights.

    Call :func:`init_parallel` first. Legacy ``GroupedMLP`` experts need ``grouped_gemm`` only for
    their forward; they build without it.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    from .cpu_patches import patch_for_cpu

    options = options or BuildOptions()
    patch_for_cpu()
    family = family_of(config)
    tconfig = transformer_config(config, layout, options)
    torch.manual_seed(options.seed)
    if options.device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(options.seed)
    else:
        _cpu_rng_tracker(options.seed)
    chunks = []
    for vp in range(layout.vpp):
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        if family.num_experts(config) or family.mla:
            spec = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization="RMSNorm",
                                              vp_stage=vp)
        else:
            spec = get_gpt_layer_local_spec(qk_layernorm=family.qk_norm, normalization="RMSNorm")
        if family.mla:
            _add_latent_norms(spec)
        mtp = None
        if tconfig.mtp_num_layers:
            layer = spec.layer_specs[-1] if hasattr(spec, "layer_specs") else spec
            mtp = get_gpt_mtp_block_spec(tconfig, layer, use_transformer_engine=False, vp_stage=vp)
        with torch.device("meta") if options.device == "meta" else _nullcontext():
            model = GPTModel(
                tconfig, spec, vocab_size=padded_vocab(config["vocab_size"], layout.tp),
                max_sequence_length=config.get("max_position_embeddings", 4096), pre_process=pre,
                post_process=post, share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
                position_embedding_type="rope", rotary_base=int(config.get("rope_theta", 10000)),
                mtp_block_spec=mtp, vp_stage=vp,
            )
        if options.device == "cuda":  # the local spec's plain torch norms are created on the CPU
            model = model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _add_latent_norms(block_spec: Any) -> None:
    """The local MLA spec leaves ``q_layernorm`` / ``kv_layernorm`` as IdentityOp (Transformer Engine
    fuses them into the up projections): give them the RMSNorm DeepSeek-V3 has."""
    from megatron.core.models.backends import LocalSpecProvider

    norm = LocalSpecProvider().layer_norm(rms_norm=True, for_qk=True)
    for layer in getattr(block_spec, "layer_specs", [block_spec]):
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = norm
        attention.kv_layernorm = norm


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _cpu_rng_tracker(seed: int) -> None:
    """Megatron's CUDA RNG tracker, seeded without CUDA (what ``model_parallel_cuda_manual_seed``
    does on GPUs); initialisation under ``use_cpu_initialization`` draws from torch's CPU RNG."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()


def model_dtype(config: dict[str, Any]) -> torch.dtype:
    return config_dtype(config)
