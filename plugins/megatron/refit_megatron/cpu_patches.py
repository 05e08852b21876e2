"""Workarounds that let megatron-core 0.16 build (and run a forward) without CUDA or Transformer Engine.

Applied by :func:`refit_megatron.build.build_gpt` on machines without CUDA; a trainer on GPUs
needs none of them. What each does:

* ``torch.cuda.current_device`` answers the CPU device (megatron allocates on it while building and in forwards).
* megatron's CUDA RNG tracker becomes a no-op fork (initialisation on CPU draws from torch's RNG).
* MLA: the local ``DotProductAttention`` rejects the ``k_channels`` / ``v_channels`` arguments MLA
  passes (dropped by a subclass), and ``multi_latent_attention.HAVE_TE`` is True when TE's import
  is mocked (set False, ``TELinear`` replaced by a class nothing is an instance of).
* legacy ``GroupedMLP`` refuses to build without the CUDA-only ``grouped_gemm`` package, which it
  needs only for its forward: the build-time assertion is lifted (a forward still fails clearly).
* with PP > 1, a tied output layer or an MTP layer makes the last stage hold a copy of the
  embedding, which ``LanguageModule.setup_embeddings_and_output_layer`` moves ``.cuda()`` before
  all-reducing it from the first stage: on CPU that move is skipped (the all-reduce runs over gloo).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_applied = False


class _NoTELinear:  # nothing is an instance of it
    pass


class _CpuRngTracker:
    """Megatron's RNG tracker interface, without CUDA: forks are no-ops."""

    def reset(self) -> None:
        pass

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        pass

    def add(self, name: str, seed: int) -> None:
        pass

    def is_initialized(self) -> bool:
        return True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield


def patch_for_cpu() -> None:
    """Apply the CPU workarounds once per process (nothing on a machine with CUDA)."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from megatron.core.transformer import multi_latent_attention

    _patch_mla(multi_latent_attention)
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    _patch_embedding_sync()


def _patch_embedding_sync() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # type: ignore[method-assign]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def _patch_mla(mla: Any) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ChannelTolerantDotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    mla.HAVE_TE = False
    mla.TELinear = _NoTELinear
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs

    backends.DotProductAttention = ChannelTolerantDotProductAttention
    gpt_layer_specs.DotProductAttention = ChannelTolerantDotProductAttention
