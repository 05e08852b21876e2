"""Where every checkpoint tensor lands in an engine's model, learned by tracing the engine's own loader.

An inference engine knows its own layouts: each parameter's weight loader (fused q/k/v offsets and
KV-head replication, gate/up halves, row/column tensor-parallel slices, vocab-parallel padding, MoE
``w13``/``w2`` per local expert) and each model's ``load_weights`` (HF names to fused parameters, tied
embeddings, renames). Rather than re-implement those rules per engine and architecture,
:func:`trace_loads` runs the model's own ``load_weights`` once, at setup, on *meta* tensors: every
loadable tensor is swapped for a meta copy of itself (a :class:`TensorSwap`), every HF tensor is a
meta tensor, and a dispatch mode records each ``copy_`` (which region of which HF tensor lands in
which region of which engine tensor, read off the views' storage offsets and strides) and each
constant ``fill_`` (padding). No byte is allocated or moved; the live model is restored afterwards.

A loader that concatenates HF tensors (``torch.cat``: SGLang fuses DeepSeek's ``q_a_proj`` and
``kv_a_proj_with_mqa`` into one ``fused_qkv_a_proj_with_mqa`` so) is traced through: the
concatenation's pieces are remembered (a :class:`Concat`), and a copy from it is recorded as one
write per HF tensor it spans (also when the loader concatenates slices of its own concatenation
again: SGLang's fused LoRA B, cut per TP rank; a ``clone`` / ``.contiguous()`` of such a box is a
concatenation of one). A write whose source is not a plain box of HF tensors, or any other
mutation of a traced tensor, is recorded as *opaque*, credited to every HF tensor the source was
built from that the tracer can see: its module then takes the loader path (see
:mod:`refit_core.kit.loadplan`), with every such tensor.
Engine plugins (vLLM, SGLang) supply the swap (which tensors, in which format) and share the rest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_core.contract.spec import Box, TensorSpec, contiguous_strides

log = logging.getLogger("refit")

aten = torch.ops.aten
_COPY_OPS = {aten.copy_.default}
_FILL_OPS = {aten.fill_.Scalar, aten.zero_.default}
_CAT_OPS = {aten.cat.default}
_CLONE_OPS = {aten.clone.default}


@dataclass(frozen=True)
class Target:
    """One tensor of an engine module, as it looks in checkpoint format (what loaders write)."""

    module: str
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    load_numel: int
    restored: bool
    """True when the engine re-materializes it around an update (vLLM's reload: most tensors);
    False for tensors that stay live and are written in place (every tensor of a plain swap)."""

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


@dataclass(frozen=True)
class ConcatPart:
    """One input of a :class:`Concat`: ``view`` (a box of HF tensor ``hf_name``) at ``start`` along the
    concatenated dimension."""

    hf_name: str
    root: torch.Tensor
    view: torch.Tensor
    start: int


@dataclass(frozen=True)
class Concat:
    """A tensor a loader made by concatenating views of HF tensors along ``dim`` (contiguous, ``shape``).

    ``result`` is that tensor, held so its storage (the recorder's key for it) is not reused.
    """

    dim: int
    shape: tuple[int, ...]
    parts: tuple[ConcatPart, ...]
    result: torch.Tensor

    @property
    def names(self) -> list[str]:
        return [p.hf_name for p in self.parts]


class TraceRecorder(TorchDispatchMode):
    """Records copies from HF meta tensors (or concatenations of them) into swapped meta targets."""

    def __init__(self, swap: TensorSwap, trace: Trace) -> None:
        super().__init__()
        self.swap = swap
        self.trace = trace
        self.sources: dict[int, tuple[str, torch.Tensor]] = {}
        self.concats: dict[int, Concat] = {}
        self.derived: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        """Storage of a computed tensor (held, so the key is not reused) -> the HF tensors it came from."""
        self.current: str | None = None

    def source(self, spec: TensorSpec) -> torch.Tensor:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        self.sources[storage_key(tensor)] = (spec.name, tensor)
        self.current = spec.name
        return tensor

    def _target(self, tensor: Any) -> tuple[str, str] | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return None
        return self.swap.by_storage.get(storage_key(tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
        else:
            out = func(*args, **kwargs)
            if func in _CAT_OPS:
                self._on_cat(out, list(args[0]), args[1] if len(args) > 1 else kwargs.get("dim", 0))
            elif func in _CLONE_OPS:  # a copy of a box (``.contiguous()`` of a slice): a concatenation of one
                self._on_cat(out, [args[0]], 0)
            self._derive(out, (*args, *kwargs.values()))
            return out
        return func(*args, **kwargs)

    def _names_of(self, tensor: Any) -> frozenset[str]:
        """The HF tensors ``tensor`` is a view of, or was computed from."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return frozenset()
        key = storage_key(tensor)
        if key in self.sources:
            return frozenset({self.sources[key][0]})
        if key in self.concats:
            return frozenset(self.concats[key].names)
        return self.derived[key][1] if key in self.derived else frozenset()

    def _derive(self, out: Any, inputs: tuple) -> None:
        """Remember which HF tensors a computed ``out`` came from (credited if it is written somewhere)."""
        names = frozenset().union(*(self._names_of(t) for arg in inputs
                                    for t in (arg if isinstance(arg, (list, tuple)) else (arg,))))
        if not names:
            return
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                key = storage_key(tensor)
                if key not in self.sources and key not in self.concats:
                    self.derived[key] = (tensor, names)

    def _opaque(self, key: tuple[str, str], why: str, names: Iterable[str] = ()) -> None:
        """Mark ``key`` as written by something not a box copy, credited to ``names`` (default: the
        HF tensor being loaded)."""
        self.trace.opaque.setdefault(key, why)
        for name in list(names) or ([self.current] if self.current is not None else []):
            self.trace.touched.setdefault(name, set()).add(key)

    def _on_cat(self, out: torch.Tensor, inputs: list[Any], dim: int) -> None:
        """Remember ``out`` as a :class:`Concat` when every input is a box of an HF tensor."""
        if not isinstance(out, torch.Tensor) or out.device.type != "meta" or not out.is_contiguous():
            return
        dim = dim % out.dim() if out.dim() else 0
        parts: list[ConcatPart] = []
        start = 0
        for tensor in inputs:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != out.dim() or tensor.device.type != "meta":
                return
            found = self.sources.get(storage_key(tensor))
            if found is not None:
                parts.append(ConcatPart(found[0], found[1], tensor, start))
            else:
                inner = self._concat_parts(tensor, dim, start)
                if inner is None:
                    return
                parts += inner
            start += tensor.shape[dim]
        self.concats[storage_key(out)] = Concat(dim, tuple(out.shape), tuple(parts), out)

    def _concat_parts(self, tensor: torch.Tensor, dim: int, start: int) -> list[ConcatPart] | None:
        """The HF pieces of ``tensor``, a plain slice of an earlier :class:`Concat` along the same ``dim``
        (a loader that re-concatenates slices of its own concatenation: SGLang's fused LoRA B, sliced
        per TP rank), as parts starting at ``start``; None if it is anything else."""
        concat = self.concats.get(storage_key(tensor))
        if concat is None or concat.dim != dim:
            return None
        placed = view_as_box(concat.shape, contiguous_strides(concat.shape), int(tensor.storage_offset()),
                             tuple(tensor.shape), tuple(tensor.stride()))
        if placed is None or any(d not in (-1, i) for i, d in enumerate(placed[1])):
            return None
        box = placed[0]
        lo, hi = box.offsets[dim], box.ends[dim]
        parts = []
        for part in concat.parts:
            first, last = max(lo, part.start), min(hi, part.start + part.view.shape[dim])
            if first >= last:
                continue
            index = [slice(o, e) for o, e in zip(box.offsets, box.ends)]
            index[dim] = slice(first - part.start, last - part.start)
            parts.append(ConcatPart(part.hf_name, part.root, part.view[tuple(index)], start + first - lo))
        return parts

    def _on_fill(self, dst: torch.Tensor, value: float) -> None:
        key = self._target(dst)
        if key is None or dst.numel() == 0:
            return
        target = self.swap.targets[key]
        placed = view_as_box(target.shape, target.stride, int(dst.storage_offset()), tuple(dst.shape),
                             tuple(dst.stride()))
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
        concat = self.concats.get(storage_key(src))
        if concat is not None:
            self._on_concat_copy(key, dst, src, concat)
            return
        found = self.sources.get(storage_key(src))
        if found is None:
            self._opaque(key, "a copy from a computed tensor (not a view of a checkpoint tensor)",
                         sorted(self._names_of(src)))
            return
        self._record(key, dst, src, *found)

    def _on_concat_copy(self, key: tuple[str, str], dst: torch.Tensor, src: torch.Tensor, concat: Concat) -> None:
        """A copy from (a box of) a concatenation: one write per HF tensor it spans."""
        for name in concat.names:
            self.trace.touched.setdefault(name, set()).add(key)
        placed = view_as_box(concat.shape, contiguous_strides(concat.shape), int(src.storage_offset()),
                             tuple(src.shape), tuple(src.stride()))
        if placed is None or src.dim() != len(concat.shape) or tuple(dst.shape) != tuple(src.shape):
            self._opaque(key, f"a copy from a concatenation of {', '.join(concat.names)} that is not a box of it",
                         concat.names)
            return
        box, dims = placed
        free = iter(d for d in range(len(concat.shape)) if d not in dims)
        order = [d if d >= 0 else next(free) for d in dims]  # view dim i walks concatenation dim order[i]
        axis = order.index(concat.dim)
        lo, hi = box.offsets[concat.dim], box.ends[concat.dim]
        for part in concat.parts:
            start, end = max(lo, part.start), min(hi, part.start + part.view.shape[concat.dim])
            if start >= end:
                continue
            index = [slice(o, e) for o, e in zip(box.offsets, box.ends)]
            index[concat.dim] = slice(start - part.start, end - part.start)
            piece = part.view[tuple(index)].permute(order)
            self._record(key, dst.narrow(axis, start - lo, end - start), piece, part.hf_name, part.root)

    def _record(self, key: tuple[str, str], dst: torch.Tensor, src: torch.Tensor, hf_name: str,
                root: torch.Tensor) -> None:
        """A copy of ``src`` (a view of HF tensor ``hf_name``, whose base is ``root``) into ``dst``."""
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
        src_offset = int(src.storage_offset() - root.storage_offset())
        src_placed = view_as_box(hf_shape, contiguous_strides(hf_shape), src_offset, tuple(src.shape),
                                 tuple(src.stride()))
        dst_placed = view_as_box(target.shape, target.stride, int(dst.storage_offset()), tuple(dst.shape),
                                 tuple(dst.stride()))
        if src_placed is None or dst_placed is None:
            self._opaque(key, f"a copy from {hf_name} that is not a box on both sides")
            return
        hf_box, src_dims = src_placed
        strides = [0] * len(hf_shape)
        for i, d in enumerate(src_dims):
            if d >= 0:
                strides[d] = dst.stride(i)
        if hf_box.numel:
            self.trace.writes.append(Write(hf_name, hf_box, key, dst_placed[0], int(dst.storage_offset()),
                                           tuple(strides)))


def _named(specs: Iterable[TensorSpec], recorder: TraceRecorder) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in specs:
        yield spec.name, recorder.source(spec)


def trace_loads(model: torch.nn.Module, specs: list[TensorSpec], *,
                swap: Callable[[torch.nn.Module], TensorSwap] = TensorSwap,
                quiet: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Trace:
    """Run ``model.load_weights`` on meta versions of ``specs`` and record where every byte lands.

    ``swap`` builds the meta stand-ins of the model's tensors; ``quiet`` wraps every traced call
    (an engine's completeness checks or logging that have no business in a trace).
    """
    load_weights: Callable[[Iterator[tuple[str, torch.Tensor]]], Any] = getattr(model, "load_weights")
    with swap(model) as swapped:
        trace = Trace(dict(swapped.targets), aliases=dict(swapped.aliases))
        recorder = TraceRecorder(swapped, trace)
        try:
            with quiet(), recorder, torch.no_grad():
                load_weights(_named(specs, recorder))
        except Exception as exc:  # noqa: BLE001 - find which names the model rejects, one by one
            log.debug("traced load_weights failed (%s); tracing tensor by tensor", exc)
            trace = Trace(dict(swapped.targets), aliases=dict(swapped.aliases))
            recorder = TraceRecorder(swapped, trace)
            for spec in specs:
                try:
                    with quiet(), recorder, torch.no_grad():
                        load_weights(_named([spec], recorder))
                except Exception as one:  # noqa: BLE001
                    trace.rejected[spec.name] = f"{type(one).__name__}: {one}"
    return trace
