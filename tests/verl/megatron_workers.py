"""verl's Megatron actor on the host, for tests/verl/test_verl_megatron.py (imported in Ray's workers).

:class:`MegatronActor` is :class:`verl_workers.Actor` (verl's ``TrainingWorker``) with verl's own
``MegatronEngineWithLMHead`` (``strategy=megatron``, mbridge, TP=2) instead of the FSDP2 engine. verl 0.9.1's
Megatron engine is written for CUDA and Transformer Engine; :func:`megatron_on_host` lets it build on the host
over gloo, and leaves the engine's own code (``_init_device_mesh``, ``make_megatron_module``, mbridge's
``load_weights``, megatron's DDP and ``Float16Module`` wrappers, ``get_per_tensor_param``) unchanged:

* refit-plugin-megatron's CPU workarounds (``patch_for_cpu``: ``torch.cuda.current_device`` answers the host,
  megatron's CUDA RNG tracker is a no-op fork), ``Module.cuda()`` keeps a module where it is (mbridge's
  ``get_model`` moves every chunk ``.cuda()``) and ``torch.cpu.empty_cache()`` does nothing (verl's
  ``load_megatron_model_to_gpu`` empties the device's cache);
* mbridge asks for Transformer Engine's layer spec, which needs CUDA: it gets megatron-core's local one, whose
  layer norms are modules of their own (``input_layernorm``, ``pre_mlp_layernorm``, instead of TE's fused
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``), so mbridge's Qwen2/3 name table learns
  those two names; the local norm refuses sequence parallelism (the test turns it off: it shapes activations,
  not parameters);
* megatron-core's optimizer allocates on ``device='cuda'`` and checks ``torch.cuda.*Tensor`` types: the
  engine is built without optimizer and LR scheduler; :meth:`MegatronActor.train_step` stands in for a step;
* verl's Megatron offload keeps its host copy in pinned memory, which needs an accelerator: on the host it is
  allocated unpinned (:func:`unpinned`, around :meth:`MegatronActor.offload_round_trip` only).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import Dispatch, register as verl_method
from verl_workers import Actor

_GATHERS = [0]
_applied = [False]


def megatron_on_host() -> None:
    """The host shims above, once per process."""
    if _applied[0]:
        return
    _applied[0] = True
    from refit_megatron.cpu_patches import patch_for_cpu

    patch_for_cpu()
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign,assignment]
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    from mbridge.core import llm_bridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from verl.workers.engine.megatron import MegatronEngine

    block_spec = llm_bridge.get_gpt_decoder_block_spec
    llm_bridge.get_gpt_decoder_block_spec = lambda config, use_transformer_engine, **kw: block_spec(config, False, **kw)
    Qwen2Bridge._OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    Qwen2Bridge._MLP_MAPPING = {**Qwen2Bridge._MLP_MAPPING, "pre_mlp_layernorm.weight": [
        "model.layers.{layer_number}.post_attention_layernorm.weight"]}
    MegatronEngine._build_optimizer = lambda self: None  # type: ignore[method-assign]
    MegatronEngine._build_lr_scheduler = lambda self: None  # type: ignore[method-assign]


@contextmanager
def unpinned() -> Iterator[None]:
    """``torch.empty(..., pin_memory=True)`` allocates plain host memory (the host has no pinned allocator)."""
    empty = torch.empty
    torch.empty = lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = empty  # type: ignore[assignment]


def count_all_gathers() -> None:
    """Count every ``torch.distributed`` all-gather of this process in ``_GATHERS`` (verl's Megatron export
    all-gathers each tensor-parallel weight whole)."""
    for name in ("all_gather", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            _GATHERS[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


class MegatronActor(Actor):
    """verl's ``TrainingWorker`` with its Megatron engine, syncing through its checkpoint engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        megatron_on_host()
        count_all_gathers()
        super().__init__(*args, **kwargs)

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> None:
        """Stands in for an optimizer step: every local shard changes in place (the same on TP replicas)."""
        with torch.no_grad():
            for index, p in enumerate(self.engine.module[0].parameters()):
                p.mul_(0.5).add_((index % 7 + step) / 64)

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight whole under its HF name, as verl's own sync exports them (mbridge all-gathers each
        tensor-parallel weight): the test's reference, independent of refit."""
        weights, _ = self.engine.get_per_tensor_param()
        return {name: tensor.detach().clone() for name, tensor in weights}

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gathers(self) -> int:
        """How many all-gathers this process made since the worker was built."""
        return _GATHERS[0]

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def offload_round_trip(self) -> bool:
        """verl's own Megatron offload and load (``offload_megatron_model_to_cpu``, ``load_megatron_model_to_gpu``):
        megatron's parameter buffers are freed, then allocated again and the values copied back. True: every
        parameter's memory was freed in between.

        In between, as a colocated rollout does when it wakes, other tensors take the freed memory, so the
        buffers come back elsewhere. Without them the host's allocator may hand each buffer its old address
        again (verl 0.9.1 keeps one host copy per buffer, so nothing else is allocated in between): the
        weights would then be where refit bound them, and nothing would have moved."""
        from verl.utils.megatron_utils import load_megatron_model_to_gpu, offload_megatron_model_to_cpu

        with unpinned():
            offload_megatron_model_to_cpu(self.engine.module)
        freed = all(p.untyped_storage().size() == 0 for p in self.engine.module[0].parameters())
        buffers = [buffer for chunk in self.engine.module for buffer in chunk.buffers]
        in_between = [torch.empty(buffer.param_data_size, dtype=buffer.param_data.dtype) for buffer in buffers]
        load_megatron_model_to_gpu(self.engine.module, load_grad=False)
        del in_between
        return freed

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """This rank's megatron parameters and their local (tensor-parallel) shapes."""
        return {name: tuple(p.shape) for name, p in self.engine.module[0].named_parameters()}
