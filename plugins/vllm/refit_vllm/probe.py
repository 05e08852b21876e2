"""Where every HF checkpoint tensor lands in a vLLM model, learned from vLLM itself.

The tracing machinery is the core's (:mod:`refit_core.kit.loadtrace`, shared with the SGLang plugin):
it runs the model's own ``load_weights`` on meta tensors and records every copy and fill. What is
vLLM's own is the swap: vLLM repacks many tensors after loading (oneDNN handles on CPU, quantized
kernels), so the traced stand-ins are rebuilt from vLLM's reload metadata -- the checkpoint format
that ``load_weights`` writes -- rather than taken from the live (kernel-format) tensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from refit_core import TensorSpec
from refit_core.kit import TensorSwap, Trace, meta_copy
from refit_core.kit import trace_loads as _trace_with

log = logging.getLogger("refit.vllm")

__all__ = ["Trace", "quiet_loads", "trace_loads"]


class _Swap(TensorSwap):
    """Checkpoint-format meta stand-ins as vLLM's layerwise reload rebuilds them."""

    def _swap_module(self, mod_name: str, module: torch.nn.Module, live_params: dict, live_buffers: dict) -> bool:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_MODULES, SKIP_TENSORS
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

        if module.__class__.__name__ in SKIP_MODULES:
            return False
        restore_params, restore_buffers = get_layerwise_info(module).restore_metadata
        if not (restore_params or restore_buffers or any(v is not None for v in live_params.values())
                or any(v is not None for v in live_buffers.values())):
            return False
        # Checkpoint format, as vLLM's reload rebuilds it: the recorded tensors, plus the
        # live ones reload never moves (``bias``; expert maps, which loaders only read; DeepSeek's
        # ``e_score_correction_bias``, a parameter its loader writes in place, traced like ``bias``).
        for live, restore, store in ((live_params, restore_params, module._parameters),
                                     (live_buffers, restore_buffers, module._buffers)):
            store.clear()
            store.update({k: None for k, v in live.items() if v is None})
            chosen = [(k, v, True) for k, v in restore.items() if k not in SKIP_TENSORS]
            chosen += [(k, v, False) for k, v in live.items() if v is not None and k in SKIP_TENSORS]
            for name, tensor, restored in chosen:
                if name in SKIP_LOAD_TENSORS and store is module._buffers:
                    store[name] = tensor
                    continue
                meta = restore_layer_refs(meta_copy(tensor), module) if restored else meta_copy(tensor)
                _unwrap_loader(meta)
                store[name] = self.register(mod_name, name, live.get(name), meta, restored=restored,
                                            load_numel=int(get_tensor_load_numel(meta)))
        return True


def _unwrap_loader(meta: torch.Tensor) -> None:
    """Give a stand-in its model's own ``weight_loader``. vLLM's layerwise reload wraps the loaders of
    the very tensors it keeps as reload metadata (``online_process_loader``, which only buffers) and
    never unwraps them there, so after any reload a trace through them would record nothing."""
    loader = getattr(meta, "weight_loader", None)
    if loader is None or getattr(loader, "__name__", None) != "online_process_loader":
        return
    while getattr(loader, "__name__", None) == "online_process_loader":
        loader = loader.__wrapped__
    meta.weight_loader = loader


@contextlib.contextmanager
def quiet_loads() -> Iterator[None]:
    """vLLM's MTP completeness check (and its logging) has no business in a trace."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # pragma: no cover - older vLLM
        yield
        return
    with disable_mtp_completeness_check():
        yield


def trace_loads(model: torch.nn.Module, specs: list[TensorSpec]) -> Trace:
    """Run ``model.load_weights`` on meta versions of ``specs`` and record where every byte lands."""
    return _trace_with(model, specs, swap=_Swap, quiet=quiet_loads)
