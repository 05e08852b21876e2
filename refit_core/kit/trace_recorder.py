"""The dispatch mode that records a loader's copies and fills into swapped meta tensors, through concatenations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_core.contract.spec import TensorSpec, contiguous_strides
from refit_core.kit.tensor_swap import TensorSwap, storage_key
from refit_core.kit.trace_records import Fill, Trace, Write
from refit_core.kit.view_geometry import view_as_box

aten = torch.ops.aten
_COPY_OPS = {aten.copy_.default}
_FILL_OPS = {aten.fill_.Scalar, aten.zero_.default}
_CAT_OPS = {aten.cat.default}
_CLONE_OPS = {aten.clone.default}


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
