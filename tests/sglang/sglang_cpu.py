"""SGLang's real model classes on CPU, as the tests build them (spawned rank programs import this).

No SGLang engine can run here (its kernels are CUDA-only); its model classes build on CPU once its
parallel state is initialized over gloo. One stand-in is needed: ``vllm._custom_ops``, which SGLang's
rotary embedding imports (as its non-CUDA fallback kernel) while it is built; the stand-in is never
called by anything these tests run (they build, load and refit weights; see test docstrings).
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

import torch

from refit_core.kit.models import PRESETS


def _stand_in_vllm_custom_ops() -> None:
    if "vllm._custom_ops" in sys.modules:
        return
    package, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("stand-in for vllm._custom_ops.rotary_embedding (SGLang on CPU)")

    ops.rotary_embedding = rotary_embedding
    package._custom_ops = ops
    package.__path__ = []
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = package, ops


def init_sglang(rank: int, world: int, port: int) -> None:
    """SGLang's distributed environment and model-parallel groups: TP ``world`` over gloo.

    SGLang's groups open NCCL and custom all-reduce communicators beside gloo when their world
    exceeds 1; on CPU those are switched off (the groups keep gloo, which is all the tests use).
    """
    import functools

    warnings.filterwarnings("ignore")
    _stand_in_vllm_custom_ops()
    from sglang.srt.distributed import parallel_state

    if not isinstance(parallel_state.init_model_parallel_group, functools.partial):
        parallel_state.init_model_parallel_group = functools.partial(
            parallel_state.init_model_parallel_group, use_pynccl=False, use_custom_allreduce=False)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.test.test_utils import publish_build_topology

    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    publish_build_topology(world_rank=rank, tp_size=world, ep_size=1, pp_size=1)
    initialize_model_parallel(backend="gloo")


def hf_config(preset: str | dict[str, Any], **overrides: Any) -> Any:
    """The transformers config of a preset name or a ``config.json`` dict."""
    from transformers import AutoConfig

    values = dict(PRESETS[preset] if isinstance(preset, str) else preset, **overrides)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def build_model(preset: str | dict[str, Any], dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """The SGLang model class for ``preset`` (a name or a config dict; random init, on CPU) in ``dtype``."""
    from sglang.srt.models.registry import ModelRegistry

    config = hf_config(preset, **overrides)
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.no_grad():
            return cls(config=config, quant_config=None).eval()
    finally:
        torch.set_default_dtype(previous)


def _stand_in_pinned_memory() -> None:
    """SGLang's LoRA layers and its torch_native LoRA backend allocate small index tensors in pinned host
    memory (``torch.tensor / zeros / empty(..., pin_memory=True)``, ``.pin_memory()``), which raises
    without an NVIDIA driver. Pinning only speeds
    host-to-device copies, so on a CPU-only host it is left out: values and shapes are unchanged."""
    if torch.cuda.is_available() or getattr(torch.tensor, "_refit_unpinned", False):
        return
    for name in ("tensor", "zeros", "empty"):
        setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def _unpinned(factory: Any) -> Any:
    def unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return factory(*args, **kwargs)

    unpinned._refit_unpinned = True  # type: ignore[attr-defined]
    return unpinned


def build_lora_manager(model: torch.nn.Module, *, max_lora_rank: int, slots: int, dtype: torch.dtype = torch.float32,
                       targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj")) -> Any:
    """SGLang's real ``LoRAManager`` over ``model`` (its LoRA layers wrap the model's linear layers, its
    ``LoRAMemoryPool`` holds ``slots`` adapters of rank <= ``max_lora_rank``), as a model runner builds it
    for ``--enable-lora --lora-backend torch_native``; needs :func:`init_sglang` first."""
    _stand_in_pinned_memory()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.runtime_context import get_server_args

    return LoRAManager(base_model=model, base_hf_config=model.config, max_loras_per_batch=slots,
                       load_config=LoadConfig(), dtype=dtype, server_args=get_server_args(),
                       lora_backend="torch_native", max_lora_rank=max_lora_rank, target_modules=set(targets))
