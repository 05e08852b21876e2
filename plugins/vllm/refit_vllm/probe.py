"""Where every HF checkpoint tensor lands in a vLLM model, learned from vLLM itself.

vLLM knows its own layouts: each parameter's ``weight_loader`` (``QKVParallelLinear``'s q/k/v offsets
and KV-head replication, ``MergedColumnParallelLinear``'s gate/up halves, row/column TP slices,
vocab-parallel sharding and padding, ``RoutedExperts``' ``w13``/``w2`` per local expert under EP)
and each model's ``load_weights`` (HF names to fused parameters, tied embeddings, renames). Rather
than re-implement those rules per architecture, :func:`trace_loads` runs the model's own
``load_weights`` once, at setup, on *meta* tensors: every parameter and buffer is swapped for a meta
copy of its checkpoint-format self (vLLM's reload metadata), every HF tensor is a meta tensor, and a
dispatch mode records each ``copy_`` (which region of which HF tensor lands in which region of which
vLLM tensor, read off the views' storage offsets and strides) and each constant ``fill_`` (padding).
No byte is allocated or moved; the live model is restored exactly afterwards.

A write whose source is not a plain box of an HF tensor, or any other mutation of a traced tensor,
is recorded as *opaque*: its module then takes the loader path (see :mod:`refit_vllm.destinations`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_core import Box, TensorSpec

log = logging.getLogger("refit.vllm")

aten = torch.ops.aten
_COPY_OPS = {aten.copy_.default}
_FILL_OPS = {aten.fill_.Scalar, aten.zero_.default}


@dataclass(frozen=True)
class Target:
    """One tensor of a vLLM module, as it looks in checkpoint format (what loaders write)."""

    module: str
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    load_numel: int
    restored: bool
    """True when vLLM's reload puts it back on meta and re-materializes it (most tensors); False
    for tensors that reload leaves live (``bias``), which are written in place."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.name)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Write:
    """``hf_box`` of HF tensor ``hf_name`` lands in ``target`` at ``dst_box``.

    ``offset`` and ``strides`` give the destination as a strided view shaped like ``hf_box`` (in HF
    dimension order): ``tensor.as_strided(hf_box.sizes, strides, offset)``.
    """

    hf_name: str
    hf_box: Box
    target: tuple[str, str]
    dst_box: Box
    offset: int
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Fill:
    """A constant a loader writes into ``dst_box`` of ``target`` (vocab padding rows)."""

    target: tuple[str, str]
    dst_box: Box
    value: float


@dataclass
class Trace:
    """Everything one traced ``load_weights`` did."""

    targets: dict[tuple[str, str], Target]
    writes: list[Write] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    touched: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    """HF name -> targets it wrote (box copies or not)."""
    opaque: dict[tuple[str, str], str] = field(default_factory=dict)
    """Target -> why some write into it is not a plain box copy."""
    rejected: dict[str, str] = field(default_factory=dict)
    """HF name -> the error the model's ``load_weights`` raised for it."""
    cast: dict[str, torch.dtype] = field(default_factory=dict)
    """HF name -> the dtype of the tensor it was copied into, where that differs from its spec."""
    aliases: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """A module's tensor that is another module's tensor (tied embeddings) -> the owner's key."""


# -- geometry ---------------------------------------------------------------------------------


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    return tuple(strides)


def view_as_box(shape: tuple[int, ...], base_stride: tuple[int, ...], offset: int,
                sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[Box, tuple[int, ...]] | None:
    """Express a strided view of a dense base tensor as a box of it.

    Returns ``(box, dims)`` where ``dims[i]`` is the base dimension that view dimension ``i`` walks
    (-1 for view dims of size 1), or None when the view is not a box (overlapping, skewed, ...).
    """
    if len(shape) == 0:
        return (Box((), ()), tuple(-1 for _ in sizes)) if offset == 0 and all(s == 1 for s in sizes) else None
    order = sorted(range(len(shape)), key=lambda d: -base_stride[d])
    coords = [0] * len(shape)
    rest = offset
    for d in order:
        if base_stride[d] == 0:
            continue
        coords[d], rest = divmod(rest, base_stride[d])
        if shape[d] and coords[d] >= shape[d]:
            return None
    if rest:
        return None
    box_sizes = [1] * len(shape)
    used: set[int] = set()
    dims = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            dims.append(-1)
            continue
        choice = [d for d in range(len(shape)) if d not in used and base_stride[d] == stride
                  and shape[d] > 1 and coords[d] + size <= shape[d]]
        if not choice:
            return None
        d = choice[0]
        used.add(d)
        box_sizes[d] = size
        dims.append(d)
    box = Box(tuple(coords), tuple(box_sizes))
    if not box.within(shape):
        return None
    return box, tuple(dims)


# -- the trace --------------------------------------------------------------------------------


def _meta_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``tensor``'s geometry, class and attributes (loaders, dims, ...)."""
    meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
    meta.__class__ = tensor.__class__
    meta.__dict__ = dict(tensor.__dict__)
    return meta


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Swap:
    """Swap every loadable tensor of ``model`` for a checkpoint-format meta copy, and back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[torch.nn.Module, dict, dict]] = []
        self.targets: dict[tuple[str, str], Target] = {}
        self.by_storage: dict[int, tuple[str, str]] = {}
        self.meta_of: dict[tuple[str, str], torch.Tensor] = {}
        self.aliases: dict[tuple[str, str], tuple[str, str]] = {}

    def __enter__(self) -> _Swap:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_MODULES, SKIP_TENSORS
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

        shared: dict[int, tuple[torch.Tensor, tuple[str, str]]] = {}  # id(live) -> meta copy (ties stay tied)
        try:
            for mod_name, module in self.model.named_modules():
                if module.__class__.__name__ in SKIP_MODULES:
                    continue
                restore_params, restore_buffers = get_layerwise_info(module).restore_metadata
                live_params, live_buffers = dict(module._parameters), dict(module._buffers)
                if not (restore_params or restore_buffers or any(v is not None for v in live_params.values())
                        or any(v is not None for v in live_buffers.values())):
                    continue
                self.saved.append((module, live_params, live_buffers))
                # Checkpoint format, as vLLM's reload rebuilds it: the recorded tensors, plus the
                # live ones reload never moves (``bias``; expert maps, which loaders only read).
                for live, restore, store in ((live_params, restore_params, module._parameters),
                                             (live_buffers, restore_buffers, module._buffers)):
                    store.clear()
                    store.update({k: None for k, v in live.items() if v is None})
                    chosen = [(k, v, True) for k, v in restore.items() if k not in SKIP_TENSORS]
                    chosen += [(k, v, False) for k, v in live.items() if v is not None and k in SKIP_TENSORS]
                    for name, tensor, restored in chosen:
                        if name in SKIP_LOAD_TENSORS:
                            store[name] = tensor
                            continue
                        live_tensor = live.get(name)
                        if live_tensor is not None and id(live_tensor) in shared:
                            store[name], owner = shared[id(live_tensor)]
                            self.aliases[(mod_name, name)] = owner
                            continue
                        meta = restore_layer_refs(_meta_copy(tensor), module) if restored else _meta_copy(tensor)
                        key = (mod_name, name)
                        if live_tensor is not None:
                            shared[id(live_tensor)] = (meta, key)
                        store[name] = meta
                        self.targets[key] = Target(mod_name, name, tuple(meta.shape), tuple(meta.stride()),
                                                   meta.dtype, int(get_tensor_load_numel(meta)), restored)
                        self.by_storage[_storage_key(meta)] = key
                        self.meta_of[key] = meta
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, params, buffers in reversed(self.saved):
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        self.saved.clear()


class _Recorder(TorchDispatchMode):
    """Records copies from HF meta tensors into swapped meta targets."""

    def __init__(self, swap: _Swap, trace: Trace) -> None:
        super().__init__()
        self.swap = swap
        self.trace = trace
        self.sources: dict[int, tuple[str, torch.Tensor]] = {}
        self.current: str | None = None

    def source(self, spec: TensorSpec) -> torch.Tensor:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        self.sources[_storage_key(tensor)] = (spec.name, tensor)
        self.current = spec.name
        return tensor

    def _target(self, tensor: Any) -> tuple[str, str] | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return None
        return self.swap.by_storage.get(_storage_key(tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _COPY_OPS:
            self._on_copy(args[0], args[1])
        elif func in _FILL_OPS:
            self._on_fill(args[0], float(args[1]) if func is aten.fill_.Scalar else 0.0)
        elif func._schema.is_mutable:
            for arg in (*args, *kwargs.values()):
                key = self._target(arg)
                if key is not None:
                    self._opaque(key, f"{func} writes into it")
        return func(*args, **kwargs)

    def _opaque(self, key: tuple[str, str], why: str) -> None:
        self.trace.opaque.setdefault(key, why)
        if self.current is not None:
            self.trace.touched.setdefault(self.current, set()).add(key)

    def _on_fill(self, dst: torch.Tensor, value: float) -> None:
        key = self._target(dst)
        if key is None or dst.numel() == 0:
            return
        target = self.swap.targets[key]
        placed = view_as_box(target.shape, target.stride, dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
        if placed is None:
            self._opaque(key, "a fill that is not a box")
            return
        if placed[0].numel:
            self.trace.fills.append(Fill(key, placed[0], value))

    def _on_copy(self, dst: torch.Tensor, src: Any) -> None:
        key = self._target(dst)
        if key is None or dst.numel() == 0:
            return
        if not isinstance(src, torch.Tensor) or src.device.type != "meta":
            self._opaque(key, "a copy from a non-checkpoint tensor")
            return
        found = self.sources.get(_storage_key(src))
        if found is None:
            self._opaque(key, "a copy from a computed tensor (not a view of a checkpoint tensor)")
            return
        hf_name, root = found
        self.current = hf_name
        self.trace.touched.setdefault(hf_name, set()).add(key)
        if dst.dtype != src.dtype:
            self.trace.cast[hf_name] = dst.dtype
            self._opaque(key, f"a casting copy from {hf_name} ({src.dtype} -> {dst.dtype})")
            return
        if tuple(dst.shape) != tuple(src.shape):
            self._opaque(key, f"a broadcasting copy from {hf_name}")
            return
        target = self.swap.targets[key]
        hf_shape = tuple(root.shape)
        src_placed = view_as_box(hf_shape, _contiguous_strides(hf_shape), src.storage_offset() - root.storage_offset(),
                                 tuple(src.shape), tuple(src.stride()))
        dst_placed = view_as_box(target.shape, target.stride, dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
        if src_placed is None or dst_placed is None:
            self._opaque(key, f"a copy from {hf_name} that is not a box on both sides")
            return
        hf_box, src_dims = src_placed
        strides = [0] * len(hf_shape)
        for i, d in enumerate(src_dims):
            if d >= 0:
                strides[d] = dst.stride(i)
        if hf_box.numel:
            self.trace.writes.append(Write(hf_name, hf_box, key, dst_placed[0], dst.storage_offset(), tuple(strides)))


def _named(specs: Iterable[TensorSpec], recorder: _Recorder) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in specs:
        yield spec.name, recorder.source(spec)


@contextlib.contextmanager
def _quiet_loads() -> Iterator[None]:
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
    with _Swap(model) as swap:
        trace = Trace(dict(swap.targets), aliases=dict(swap.aliases))
        recorder = _Recorder(swap, trace)
        try:
            with _quiet_loads(), recorder, torch.no_grad():
                model.load_weights(_named(specs, recorder))
        except Exception as exc:  # noqa: BLE001 - find which names the model rejects, one by one
            log.debug("traced load_weights failed (%s); tracing tensor by tensor", exc)
            trace = Trace(dict(swap.targets), aliases=dict(swap.aliases))
            recorder = _Recorder(swap, trace)
            for spec in specs:
                try:
                    with _quiet_loads(), recorder, torch.no_grad():
                        model.load_weights(_named([spec], recorder))
                except Exception as one:  # noqa: BLE001
                    trace.rejected[spec.name] = f"{type(one).__name__}: {one}"
    return trace
