"""Every loadable tensor of an engine model swapped for a meta copy of itself for a trace, and back."""

from __future__ import annotations

from typing import Any, Self

import torch

from refit_core.kit.trace_records import Target


def meta_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``tensor``'s geometry, class and attributes (loaders, dims, ...)."""
    meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
    meta.__class__ = tensor.__class__
    meta.__dict__ = dict(tensor.__dict__)
    return meta


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class TensorSwap:
    """Swap every loadable tensor of ``model`` for a checkpoint-format meta copy, and back.

    This base class swaps the live parameters and buffers as they are (engines whose parameters
    keep checkpoint format, such as SGLang's unquantized layers); an engine that re-lays tensors
    out after loading overrides :meth:`_swap_module` (vLLM rebuilds them from its reload metadata).
    Tensors shared between modules (tied embeddings) stay shared: the later owner is an alias.
    Tensors a traced loader sets as plain module attributes (SGLang's DeepSeek ``post_load_weights``
    derives ``w_kc`` / ``w_vc`` so, from meta tensors during a trace) are put back as they were.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[torch.nn.Module, dict, dict]] = []
        self.targets: dict[tuple[str, str], Target] = {}
        self.by_storage: dict[int, tuple[str, str]] = {}
        self.meta_of: dict[tuple[str, str], torch.Tensor] = {}
        self.aliases: dict[tuple[str, str], tuple[str, str]] = {}
        self._shared: dict[int, tuple[torch.Tensor, tuple[str, str]]] = {}
        self._attributes: list[tuple[torch.nn.Module, dict[str, Any]]] = []

    def __enter__(self) -> Self:
        self._attributes = [(module, {k: v for k, v in vars(module).items()
                                      if v is None or isinstance(v, torch.Tensor)})
                            for module in self.model.modules()]
        try:
            for mod_name, module in self.model.named_modules():
                live_params, live_buffers = dict(module._parameters), dict(module._buffers)
                if self._swap_module(mod_name, module, live_params, live_buffers):
                    self.saved.append((module, live_params, live_buffers))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _swap_module(self, mod_name: str, module: torch.nn.Module, live_params: dict, live_buffers: dict) -> bool:
        """Replace ``module``'s tensors by meta copies (through :meth:`register`); True if it swapped any."""
        if not any(v is not None for v in (*live_params.values(), *live_buffers.values())):
            return False
        stores: tuple[tuple[dict, dict[str, Any]], ...] = ((live_params, module._parameters),
                                                          (live_buffers, module._buffers))
        for live, store in stores:
            for name, tensor in live.items():
                if tensor is not None:
                    store[name] = self.register(mod_name, name, tensor, meta_copy(tensor), restored=False,
                                                load_numel=tensor.numel())
        return True

    def register(self, mod_name: str, name: str, live: torch.Tensor | None, meta: torch.Tensor, *,
                 restored: bool, load_numel: int) -> torch.Tensor:
        """Record ``meta`` as the traced stand-in of ``mod_name.name``; returns what to put in its place
        (the first owner's meta copy when ``live`` is shared with a module registered before)."""
        key = (mod_name, name)
        if live is not None and id(live) in self._shared:
            shared, owner = self._shared[id(live)]
            self.aliases[key] = owner
            return shared
        if live is not None:
            self._shared[id(live)] = (meta, key)
        self.targets[key] = Target(mod_name, name, tuple(meta.shape), tuple(meta.stride()), meta.dtype,
                                   load_numel, restored)
        self.by_storage[storage_key(meta)] = key
        self.meta_of[key] = meta
        return meta

    def __exit__(self, *exc: object) -> None:
        for module, params, buffers in reversed(self.saved):
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        self.saved.clear()
        for module, before in self._attributes:
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and (name not in before or before[name] is not value):
                    if name in before:
                        setattr(module, name, before[name])
                    else:
                        delattr(module, name)
        self._attributes.clear()
