"""Many (destination view, source view) copies run as few copy kernels: the colocated receiver's step.

A colocated gen rank copies every segment straight from a view of the trainer's memory into a view
of the engine's memory; nothing is staged on either side. :class:`CopyProgram` resolves those copies
once, at bind time, into the fewest launches that move exactly the same bytes:

1. :func:`coalesce` merges copies that are neighbours in memory on both sides: into one flat copy
   (consecutive rows), along a dimension (an expert stack's ``[:, :I]`` gate and ``[:, I:]`` up
   halves: one ``[E, 2I, H]`` copy), and runs of equal-layout copies at constant distances into one
   strided copy with a new leading dimension (Megatron's per-query-group ``q``/``k``/``v`` blocks of
   ``linear_qkv`` into vLLM's ``[Q; K; V]``: one copy each per layer).
2. :func:`widen` moves a same-dtype copy as the same bytes in the widest integer words both views
   allow (a strided bf16 copy then moves 8 bytes per element instead of 2; integers copy bit for bit).
3. Copies of at least ``batch_below`` bytes run one by one, largest first: contiguous ones (a plain
   device memcpy) first, then strided ones, moved as :class:`StridedCopy` says (one strided kernel,
   one memcpy per block, the blocks in one multi-tensor copy, one 2-D memcpy, or all of them in one
   Triton launch); smaller ones run as one ``torch._foreach_copy_`` per dtype pair, contiguous and
   strided apart (a list of dense equal-stride pairs takes torch's single-kernel multi-tensor route
   on CUDA: a model's many small experts and norms cost a few launches, not thousands).

Casts (a destination dtype other than the source's) are copies too: ``copy_`` reads the source dtype
and writes the destination's, so they need no staging either.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.contract.options import StridedCopy
from refit_core.run import triton_copies

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view), equal shapes

BATCH_BELOW = 8 << 20
"""Copies smaller than this join a multi-tensor batch. On an H200 a device memcpy launch costs
~5 us of host time, which moves ~10 MB at the copy rate; torch's multi-tensor copy of 2 MiB slices
runs at ~0.65 of a memcpy (../shared/DESIGN.md): below ~8 MiB one launch for many wins."""

_WORDS = (torch.int64, torch.int32, torch.int16)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts where contiguous ``a`` ends, in the same storage and dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous() and _storage(a) == _storage(b)
            and b.data_ptr() == a.data_ptr() + _nbytes(a))


def _span(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=a.dtype, device=a.device).set_(a.untyped_storage(), a.storage_offset(),
                                                               (a.numel() + b.numel(),), (1,))


def _next_along(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The dimension along which ``b`` continues ``a`` (same storage, dtype and strides, shapes equal
    elsewhere, ``b`` starting one step past ``a``'s end on it); None if there is none."""
    if (a.dtype != b.dtype or a.dim() != b.dim() or a.dim() == 0 or a.stride() != b.stride()
            or _storage(a) != _storage(b)):
        return None
    differ = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
    if len(differ) > 1:
        return None
    candidates = differ or range(a.dim())
    gap = b.storage_offset() - a.storage_offset()
    for d in candidates:
        if a.stride(d) > 0 and gap == a.shape[d] * a.stride(d):
            return d
    return None


def _along(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(a.shape)
    shape[dim] += b.shape[dim]
    return a.as_strided(shape, a.stride(), a.storage_offset())


def _merge(a: Pair, b: Pair) -> Pair | None:
    """Copy ``a`` and copy ``b`` as one copy of the same bytes, if their views are neighbours on both
    sides (flat, or along the same dimension); None otherwise."""
    (dst_a, src_a), (dst_b, src_b) = a, b
    if _adjacent(dst_a, dst_b) and _adjacent(src_a, src_b):
        return _span(dst_a, dst_b), _span(src_a, src_b)
    dim = _next_along(dst_a, dst_b)
    if dim is not None and _next_along(src_a, src_b) == dim and dst_a.shape == src_a.shape:
        return _along(dst_a, dst_b, dim), _along(src_a, src_b, dim)
    return None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and _storage(a) == _storage(b)


def _step(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements from ``a``'s first element to ``b``'s (0 if not a positive whole number)."""
    delta = b.data_ptr() - a.data_ptr()
    return delta // a.element_size() if delta > 0 and delta % a.element_size() == 0 else 0


def _stack(run: list[Pair], steps: tuple[int, int]) -> Pair:
    """Equal-layout copies at constant distances as one copy of two views with a new leading dim."""
    (dst, src), (dst_step, src_step) = run[0], steps
    if len(run) == 1:
        return dst, src
    return (dst.as_strided((len(run), *dst.shape), (dst_step, *dst.stride()), dst.storage_offset()),
            src.as_strided((len(run), *src.shape), (src_step, *src.stride()), src.storage_offset()))


def coalesce(pairs: Sequence[Pair]) -> list[Pair]:
    """(destination, source) copies batched into as few copies as possible, exactly the same bytes.

    Copies are taken in destination memory order. Neighbours in memory on both sides merge into one
    flat copy (``[gate_e; up_e]`` of every expert: one copy per stacked tensor) or into one copy along
    the dimension they continue (``w13[:, :I]`` and ``w13[:, I:]`` from ``fc1[:, :I]`` and
    ``fc1[:, I:]``); then runs of equal-layout copies at constant distances on both sides become one
    strided copy (Megatron's per-group ``q``/``k``/``v`` blocks: one copy each per layer).
    Destinations never overlap, so a merged view covers exactly the bytes of the copies it replaces.
    """
    ordered = sorted((p for p in pairs if p[0].numel()), key=lambda p: (_storage(p[0]), p[0].data_ptr()))
    merged: list[Pair] = []
    for pair in ordered:
        joined = _merge(merged[-1], pair) if merged else None
        if joined is not None:
            merged[-1] = joined
        else:
            merged.append(pair)
    out: list[Pair] = []
    run: list[Pair] = []
    steps = (0, 0)
    for dst, src in merged:
        if run and _same_layout(run[-1][0], dst) and _same_layout(run[-1][1], src):
            step = (_step(run[-1][0], dst), _step(run[-1][1], src))
            if all(step) and (len(run) == 1 or step == steps):
                run.append((dst, src))
                steps = step
                continue
        if run:
            out.append(_stack(run, steps))
        run, steps = [(dst, src)], (0, 0)
    if run:
        out.append(_stack(run, steps))
    return out


def widen(dst: torch.Tensor, src: torch.Tensor) -> Pair:
    """A same-dtype copy as views of the same bytes in the widest integer word (8, 4 or 2 bytes) that
    both views' last dimension (stride 1), other strides and offsets allow; else unchanged.
    Integer words copy bit for bit (NaN payloads included)."""
    if dst.dtype != src.dtype or dst.dim() == 0:
        return dst, src
    for word in _WORDS:
        if word.itemsize <= dst.element_size():
            break
        if dst.stride(-1) != 1 or src.stride(-1) != 1:
            break
        try:
            return dst.view(word), src.view(word)
        except RuntimeError:  # a size, stride or offset not a whole number of words
            continue
    return dst, src


MIN_BLOCK_BYTES = 1 << 20
"""Blocks smaller than this stay inside one strided copy (``blocks`` / ``foreach`` variants)."""


def blocks(dst: torch.Tensor, src: torch.Tensor, min_bytes: int = 0) -> list[Pair] | None:
    """A copy split along its leading dimensions into pairs that are contiguous on both sides
    (exactly the same bytes), or None if that needs blocks smaller than ``min_bytes`` (or a split
    below the last dimension)."""
    if dst.is_contiguous() and src.is_contiguous():
        return [(dst, src)]
    if dst.dim() < 2 or dst.shape[0] == 0 or _nbytes(dst[0]) < max(min_bytes, 1):
        return None
    out: list[Pair] = []
    for i in range(dst.shape[0]):
        part = blocks(dst[i], src[i], min_bytes)
        if part is None:
            return None
        out += part
    return out


MAX_PITCH = (1 << 31) - 1
"""The largest pitch ``cudaMemcpy2DAsync`` is sure to take (``cudaDevAttrMaxPitch`` on current GPUs);
wider stacks keep the strided kernel."""


@dataclass(frozen=True)
class Pitched:
    """A stacked copy as ``height`` contiguous blocks of ``width`` bytes, ``dst_pitch`` / ``src_pitch``
    bytes apart (the arguments of ``cudaMemcpy2DAsync``)."""

    dst: int
    src: int
    dst_pitch: int
    src_pitch: int
    width: int
    height: int


def pitched(dst: torch.Tensor, src: torch.Tensor) -> Pitched | None:
    """``(dst, src)`` as a :class:`Pitched` copy if both are ``[n, ...]`` stacks of contiguous blocks at
    positive distances (same dtype); else None."""
    if dst.dtype != src.dtype or dst.dim() < 2 or dst.shape[0] < 1:
        return None
    if not (dst[0].is_contiguous() and src[0].is_contiguous()):
        return None
    size = dst.element_size()
    width = _nbytes(dst[0])
    dst_pitch, src_pitch = dst.stride(0) * size, src.stride(0) * size
    if dst.shape[0] > 1 and (dst_pitch < width or src_pitch < width):
        return None
    if max(dst_pitch, src_pitch, width) > MAX_PITCH:
        return None
    return Pitched(dst.data_ptr(), src.data_ptr(), max(dst_pitch, width), max(src_pitch, width), width,
                   dst.shape[0])


@dataclass(frozen=True)
class CopyCounts:
    """What a :class:`CopyProgram` runs per step."""

    segments: int
    """Copies asked for (one per plan segment)."""
    copies: int
    """Copies left after merging neighbours and stacking equal blocks."""
    launches: int
    """Copy calls per step: one per large copy and one per batch."""
    batched: int
    """Small copies inside those batches."""
    strided: int
    """Copies of views that are not contiguous (one strided kernel each, or inside a batch)."""
    widened: int
    """Copies moved as wider integer words than their dtype."""
    strided_bytes: int = 0
    """Bytes of the large (unbatched) strided copies: what :class:`StridedCopy` chooses how to move."""


CATEGORIES = ("contiguous", "strided", "batched")
"""A program's launch groups, in the order they run: large contiguous copies (device memcpys, largest
first, so the device is busy at once), large strided copies (as :class:`StridedCopy` says), batches."""


class CopyProgram:
    """Copies resolved once (:func:`coalesce`, :func:`widen`), run every step with few launches.

    ``run()`` queues every copy on the current stream (CUDA) or copies synchronously (CPU); the
    caller orders it after the work it depends on and waits for it. ``strided`` picks how large
    non-contiguous copies move (:class:`StridedCopy`); every choice moves exactly the same bytes.
    """

    def __init__(self, pairs: Sequence[Pair], batch_below: int = BATCH_BELOW,
                 strided: StridedCopy = StridedCopy.TRITON, min_block_bytes: int = MIN_BLOCK_BYTES) -> None:
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"a copy from shape {tuple(src.shape)} into shape {tuple(dst.shape)}")
        self.strided = StridedCopy(strided)
        merged = coalesce(pairs)
        dense_singles: list[Pair] = []
        strided_singles: list[Pair] = []
        batches: dict[tuple[torch.dtype, torch.dtype, bool], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        widened = strided_count = 0
        for dst, src in merged:
            wide_dst, wide_src = widen(dst, src)
            widened += wide_dst.dtype != dst.dtype
            dense = wide_dst.is_contiguous() and wide_src.is_contiguous()
            strided_count += not dense
            if _nbytes(wide_dst) >= batch_below:
                (dense_singles if dense else strided_singles).append((wide_dst, wide_src))
            else:
                dsts, srcs = batches.setdefault((wide_dst.dtype, wide_src.dtype, dense), ([], []))
                dsts.append(wide_dst)
                srcs.append(wide_src)
        dense_singles.sort(key=lambda p: _nbytes(p[0]), reverse=True)  # the device is busy at once
        strided_singles.sort(key=lambda p: _nbytes(p[0]), reverse=True)
        self._groups: dict[str, list[Callable[[], None]]] = {
            "contiguous": [_copy(d, s) for d, s in dense_singles],
            "strided": self._strided_launches(strided_singles, min_block_bytes),
            "batched": [_foreach(d, s) for d, s in batches.values()],
        }
        self.counts = CopyCounts(segments=len(pairs), copies=len(merged),
                                 launches=sum(len(g) for g in self._groups.values()),
                                 batched=sum(len(d) for d, _ in batches.values()), strided=strided_count,
                                 widened=widened, strided_bytes=sum(_nbytes(d) for d, _ in strided_singles))

    def _strided_launches(self, pairs: list[Pair], min_block_bytes: int) -> list[Callable[[], None]]:
        """The launches of the large strided copies, as :attr:`strided` says (kernel where it cannot)."""
        launches: list[Callable[[], None]] = []
        gathered: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        if self.strided is StridedCopy.TRITON:
            tiled = [triton_copies.qualifies(d, s) for d, s in pairs]
            if any(tiled):
                launches += triton_copies.TritonCopies([p for p, t in zip(pairs, tiled) if t]).launches()
                pairs = [p for p, t in zip(pairs, tiled) if not t]
        for dst, src in pairs:
            if self.strided is StridedCopy.MEMCPY2D and dst.device.type == "cuda":
                shape = pitched(dst, src)
                if shape is not None:
                    launches.append(_memcpy2d(shape, dst.device))
                    continue
            split = (blocks(dst, src, min_block_bytes)
                     if self.strided in (StridedCopy.BLOCKS, StridedCopy.FOREACH, StridedCopy.TRITON) else None)
            if split is None:
                launches.append(_copy(dst, src))
            elif self.strided is StridedCopy.BLOCKS:
                launches += [_copy(d, s) for d, s in split]
            else:
                dsts, srcs = gathered.setdefault((dst.dtype, src.dtype), ([], []))
                dsts += [d for d, _ in split]
                srcs += [s for _, s in split]
        return launches + [_foreach(d, s) for d, s in gathered.values()]

    def run(self) -> None:
        """Queue (CUDA) or run (CPU) every copy once."""
        for group in self._groups.values():
            for launch in group:
                launch()

    def run_timed(self) -> list[tuple[str, torch.cuda.Event]]:
        """:meth:`run` with a CUDA timing event recorded on the current stream before the first
        launch and after each group of :data:`CATEGORIES`: ``[("begin", e), (category, e), ...]``
        (the device time of a category is the time from the previous event to its own)."""
        marks = [("begin", _event())]
        for name, group in self._groups.items():
            for launch in group:
                launch()
            marks.append((name, _event()))
        return marks


@dataclass(frozen=True)
class BufferView:
    """A view of a staging buffer by layout only: dtype, shape, strides and offset (elements)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of_view(cls, view: torch.Tensor) -> BufferView:
        return cls(view.dtype, tuple(view.shape), tuple(view.stride()), int(view.storage_offset()))

    def on(self, buffer: torch.Tensor) -> torch.Tensor:
        """This view of ``buffer`` (a fresh uint8 buffer of the layout's size)."""
        return buffer.view(self.dtype).as_strided(self.shape, self.stride, self.offset)


class StagingCopies:
    """The copies between a round's local views and any staging buffer of its layout, planned once.

    ``local[i]`` pairs with ``staged[i]``, a view of ``template`` (a buffer of the round's layout,
    only read for addresses at construction). ``into_buffer`` says the direction: the sender packs
    local views into the buffer, the receiver unpacks the buffer into local views. The pairs are
    coalesced and widened as :class:`CopyProgram` does and grouped by dtype pair, so a step makes
    only the merged copies' buffer views and runs a few launches, not one per segment (a round of
    Megatron's per-query-group ``k`` / ``v`` blocks and their FP8 scales is thousands of segments).
    """

    def __init__(self, local: Sequence[torch.Tensor], staged: Sequence[torch.Tensor], *, into_buffer: bool,
                 batch_below: int = BATCH_BELOW) -> None:
        self.into_buffer = into_buffer
        pairs = [(s, v) if into_buffer else (v, s) for v, s in zip(local, staged)]
        self.singles: list[tuple[torch.Tensor, BufferView]] = []
        self.batches: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[BufferView]]] = {}
        for dst, src in coalesce(pairs):
            dst, src = widen(dst, src)
            view, staged_view = (src, dst) if into_buffer else (dst, src)
            layout = BufferView.of_view(staged_view)
            if _nbytes(dst) >= batch_below:
                self.singles.append((view, layout))
            else:
                views, layouts = self.batches.setdefault((dst.dtype, src.dtype), ([], []))
                views.append(view)
                layouts.append(layout)
        self.singles.sort(key=lambda p: _nbytes(p[0]), reverse=True)

    @property
    def launches(self) -> int:
        return len(self.singles) + len(self.batches)

    def run(self, buffer: torch.Tensor) -> None:
        for view, layout in self.singles:
            staged = layout.on(buffer)
            (staged.copy_(view) if self.into_buffer else view.copy_(staged))
        for views, layouts in self.batches.values():
            staged_views = [layout.on(buffer) for layout in layouts]
            if self.into_buffer:
                torch._foreach_copy_(staged_views, views)
            else:
                torch._foreach_copy_(views, staged_views)


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def launch() -> None:
        dst.copy_(src)
    return launch


def _foreach(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Callable[[], None]:
    def launch() -> None:
        torch._foreach_copy_(dsts, srcs)
    return launch


def _memcpy2d(shape: Pitched, device: torch.device) -> Callable[[], None]:
    copy = cuda_memcpy2d()

    def launch() -> None:
        stream = torch.cuda.current_stream(device).cuda_stream
        status = copy(shape.dst, shape.dst_pitch, shape.src, shape.src_pitch, shape.width, shape.height,
                      _DEVICE_TO_DEVICE, stream)
        if status:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status} "
                               f"({shape.height} blocks of {shape.width} bytes)")
    return launch


_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


@functools.cache
def cuda_memcpy2d() -> Any:
    """``cudaMemcpy2DAsync`` of the CUDA runtime torch has loaded (found in this process's mappings, so
    the same runtime and context as torch's); RuntimeError naming what is missing."""
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if "libcudart" in os.path.basename(name):
                path = name
                break
    if path is None:
        raise RuntimeError("StridedCopy.MEMCPY2D needs the CUDA runtime library (libcudart) that torch "
                           "loads; none is loaded in this process")
    function = ctypes.CDLL(path).cudaMemcpy2DAsync
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return function


__all__ = ["BATCH_BELOW", "CATEGORIES", "MIN_BLOCK_BYTES", "BufferView", "CopyCounts", "CopyProgram", "Pitched",
           "StagingCopies", "StridedCopy", "blocks", "coalesce", "pitched", "widen"]
