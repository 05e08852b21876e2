"""SGLang's own forward pass on CPU (one prefill batch), and HF transformers' logits to compare with.

What runs is SGLang's real code: the model class's ``forward`` over a real ``ForwardBatch``
(``ForwardMode.EXTEND``, one request per prompt), SGLang's ``TorchNativeAttnBackend`` (its
``torch_native`` attention backend: SDPA over the KV cache) with a real ``ReqToTokenPool`` and
``MHATokenToKVPool``, published through SGLang's ``forward_context``, and its ``LogitsProcessor``
(tensor-parallel vocab gathered over SGLang's gloo group). The layers pick SGLang's own CPU paths:
rotary ``forward_native``, ``UnquantizedFusedMoEMethod.forward_cpu`` (``moe_forward_native``),
``fused_topk_torch_native``. The one stand-in is the model runner handed to the attention backend's
constructor (it only reads ``device`` and the two pools from it).

DeepSeek-V3 (MLA) keeps its KV cache as latents (``MLATokenToKVPool``). SGLang registers no MLA
forward-method choice for ``torch_native``, so its DeepSeek attention falls back to the triton
backend's choice, which for a fresh prefill is the MHA path; that path hands the attention backend
the expanded k / v but leaves only latents in the pool, and ``TorchNativeAttnBackend`` reads k / v
from the pool (wrong shapes and values). The forward here therefore selects SGLang's absorbed MLA
path (``AttnForwardMethod.MLA``: ``w_kc`` / ``w_vc`` from ``post_load_weights``, attention over the
latent cache) for ``torch_native``, through SGLang's own ``AttentionBackendRegistry``.

The reference is HF transformers loading the same tensors through its own ``from_pretrained``
(its own checkpoint conversion, e.g. per-expert tensors into fused expert parameters).
"""

from __future__ import annotations

import os
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch

TORCH_NATIVE = "torch_native"
PROMPTS: tuple[tuple[int, ...], ...] = ((3, 141, 59, 265, 358, 97, 93, 238), (17, 4, 400, 12, 77))
"""Two requests of different lengths in one prefill batch."""
LOGITS_TOLERANCE = 1e-5
"""Largest |SGLang - HF| logit difference, relative to the largest |logit|, accepted in fp32 (measured
about 5e-7: the two compute the same sums in different orders)."""


def _kv_pool(model: torch.nn.Module, size: int, dtype: torch.dtype) -> Any:
    """SGLang's KV cache pool for ``model``: latents for MLA models, heads for the rest."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    config = model.config
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        _select_mla_forward_for_torch_native()
        return MLATokenToKVPool(size=size, page_size=1, dtype=dtype, kv_lora_rank=config.kv_lora_rank,
                                qk_rope_head_dim=config.qk_rope_head_dim, layer_num=layers, device="cpu",
                                enable_memory_saver=False)
    from sglang.srt.layers.radix_attention import RadixAttention

    attention = next(m for m in model.modules() if isinstance(m, RadixAttention))
    return MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=attention.tp_k_head_num,
                            head_dim=attention.qk_head_dim, layer_num=layers, device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False)


def _select_mla_forward_for_torch_native() -> None:
    """DeepSeek attention on ``torch_native`` takes SGLang's absorbed MLA path (module docstring)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods import AttnForwardMethod

    AttentionBackendRegistry.register(TORCH_NATIVE, lambda attn, forward_batch: AttnForwardMethod.MLA)


@torch.no_grad()
def sglang_logits(model: torch.nn.Module, vocab: int, prompts: tuple[tuple[int, ...], ...] = PROMPTS,
                  prepare: Callable[[Any], None] | None = None) -> torch.Tensor:
    """Next-token logits ``[len(prompts), vocab]`` of SGLang's forward of one prefill batch (every
    TP rank calls it together); ``prepare`` sees the ``ForwardBatch`` before the forward (a LoRA
    manager's ``prepare_lora_batch``)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    lens = [len(p) for p in prompts]
    total = sum(lens)
    dtype = next(model.parameters()).dtype
    req_pool = ReqToTokenPool(size=len(prompts), max_context_len=max(lens), device="cpu",
                              enable_memory_saver=False)
    kv_pool = _kv_pool(model, total + 1, dtype)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    backend = TorchNativeAttnBackend(runner)
    backend.prefill_attention_backend_str = backend.decode_attention_backend_str = TORCH_NATIVE
    loc = torch.arange(1, total + 1)  # slot 0 is the pool's padding slot
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for i, (start, n) in enumerate(zip(starts, lens)):
        req_pool.req_to_token[i, :n] = loc[start:start + n]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    seq_lens = torch.tensor(lens)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(prompts), input_ids=ids,
        req_pool_indices=torch.arange(len(prompts)), seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        out_cache_loc=loc, seq_lens_sum=total, positions=positions, extend_num_tokens=total,
        extend_seq_lens=seq_lens, extend_prefix_lens=torch.zeros(len(prompts), dtype=torch.long),
        extend_start_loc=torch.tensor(starts), extend_prefix_lens_cpu=[0] * len(prompts),
        extend_seq_lens_cpu=lens, extend_logprob_start_lens_cpu=lens, capture_hidden_mode=CaptureHiddenMode.NULL)
    if prepare is not None:
        prepare(batch)
    backend.init_forward_metadata(batch)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=batch):
        out = model(ids, positions, batch)
    return out.next_token_logits[:, :vocab].clone()


@torch.no_grad()
def hf_logits(hf_config: Any, state_dict: dict[str, torch.Tensor], prompts: tuple[tuple[int, ...], ...] = PROMPTS
              ) -> torch.Tensor:
    """Next-token logits of HF transformers' model loaded by ``from_pretrained`` from ``state_dict``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        hf_config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(folder, "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])


def compare_logits(model: torch.nn.Module, hf_config: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """SGLang's logits against HF's for the same weights: the largest difference relative to the
    largest logit, and whether every prompt's greedy next token agrees."""
    ours = sglang_logits(model, hf_config.vocab_size)
    theirs = hf_logits(hf_config, state_dict)
    return {"rel_diff": float((ours - theirs).abs().max() / theirs.abs().max()),
            "same_argmax": bool(torch.equal(ours.argmax(-1), theirs.argmax(-1)))}
