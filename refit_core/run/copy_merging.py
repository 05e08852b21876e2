"""Many copies made few before they run: neighbours merged, equal blocks stacked, words widened.

:func:`coalesce` merges copies that are neighbours in memory on both sides (flat, or along a dimension)
and stacks runs of equal-layout copies at constant distances into one strided copy; :func:`widen` moves
a same-dtype copy as the same bytes in the widest integer words both views allow. Both keep exactly the
same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view), equal shapes

_WORDS = (torch.int64, torch.int32, torch.int16)


class Strided(NamedTuple):
    """A strided view by its layout alone, no tensor made: its storage (by address), the offset of its first
    element there and its shape and strides (elements), its dtype and element size, and its device."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> Strided:
        return cls(t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride(), t.dtype,
                   t.element_size(), t.device)

    @property
    def address(self) -> int:
        """Its first element's address (``data_ptr()``)."""
        return self.storage + self.offset * self.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """``is_contiguous()``: dense, row-major (dimensions of size 1 take any stride)."""
        expected = 1
        for n, st in zip(reversed(self.shape), reversed(self.stride)):
            if n != 1:
                if st != expected:
                    return self.numel == 0
                expected *= n
        return True

    def boxed(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Strided:
        """Its ``sizes`` box at ``offsets`` (what :meth:`Box.slice_of` selects)."""
        offset = self.offset
        for o, st in zip(offsets, self.stride):
            offset += o * st
        return Strided(self.storage, offset, sizes, self.stride, self.dtype, self.itemsize, self.device)

    def on(self, base: torch.Tensor, layout: Strided | None = None) -> torch.Tensor:
        """This layout as a view of ``base`` (a tensor of its storage and dtype; ``layout``: its layout, if
        known); ``base`` itself if it is that."""
        if layout is None:
            layout = Strided.of(base)
        if (self.offset, self.shape, self.stride) == (layout.offset, layout.shape, layout.stride):
            return base
        return base.as_strided(self.shape, self.stride, self.offset)

    def fresh(self, base: torch.Tensor) -> torch.Tensor:
        """This layout as a new tensor on ``base``'s storage (not a view of ``base``: no autograd history)."""
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(base.untyped_storage(), self.offset,
                                                                       self.shape, self.stride)


class Merged(NamedTuple):
    """A copy :func:`coalesce_layouts` made of one or more copies: its two layouts, the first of those copies
    (whose tensors it is a view of), and whether it spans neighbours flat (then it is made afresh on their
    storage, as a flat merge always was, not as a view)."""

    dst: Strided
    src: Strided
    first: int
    fresh: bool = False

    def views(self, dst: torch.Tensor, src: torch.Tensor) -> Pair:
        """The copy's two views, made from its first copy's tensors ``dst`` and ``src``."""
        if self.fresh:
            return self.dst.fresh(dst), self.src.fresh(src)
        return self.dst.on(dst), self.src.on(src)


def view_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _adjacent(a: Strided, b: Strided) -> bool:
    """Whether ``b`` starts where contiguous ``a`` ends, in the same storage and dtype."""
    return (a.dtype == b.dtype and a.storage == b.storage and b.address == a.address + a.numel * a.itemsize
            and a.contiguous and b.contiguous)


def _span(a: Strided, b: Strided) -> Strided:
    return a._replace(shape=(a.numel + b.numel,), stride=(1,))


def _next_along(a: Strided, b: Strided) -> int | None:
    """The dimension along which ``b`` continues ``a`` (same storage, dtype and strides, shapes equal
    elsewhere, ``b`` starting one step past ``a``'s end on it); None if there is none."""
    if (a.dtype != b.dtype or len(a.shape) != len(b.shape) or not a.shape or a.stride != b.stride
            or a.storage != b.storage):
        return None
    differ = [d for d in range(len(a.shape)) if a.shape[d] != b.shape[d]]
    if len(differ) > 1:
        return None
    candidates = differ or range(len(a.shape))
    gap = b.offset - a.offset
    for d in candidates:
        if a.stride[d] > 0 and gap == a.shape[d] * a.stride[d]:
            return d
    return None


def _along(a: Strided, b: Strided, dim: int) -> Strided:
    shape = list(a.shape)
    shape[dim] += b.shape[dim]
    return a._replace(shape=tuple(shape))


def _merge(a: Merged, b: Merged) -> Merged | None:
    """Copy ``a`` and copy ``b`` as one copy of the same bytes, if their views are neighbours on both
    sides (flat, or along the same dimension); None otherwise."""
    if _adjacent(a.dst, b.dst) and _adjacent(a.src, b.src):
        return Merged(_span(a.dst, b.dst), _span(a.src, b.src), a.first, True)
    dim = _next_along(a.dst, b.dst)
    if dim is not None and _next_along(a.src, b.src) == dim and a.dst.shape == a.src.shape:
        return Merged(_along(a.dst, b.dst, dim), _along(a.src, b.src, dim), a.first, a.fresh)
    return None


def _same_layout(a: Strided, b: Strided) -> bool:
    return a.shape == b.shape and a.stride == b.stride and a.dtype == b.dtype and a.storage == b.storage


def _step(a: Strided, b: Strided) -> int:
    """Elements from ``a``'s first element to ``b``'s (0 if not a positive whole number)."""
    delta = b.address - a.address
    return delta // a.itemsize if delta > 0 and delta % a.itemsize == 0 else 0


def _stack(run: list[Merged], steps: tuple[int, int]) -> Merged:
    """Equal-layout copies at constant distances as one copy of two views with a new leading dim."""
    first, (dst_step, src_step) = run[0], steps
    if len(run) == 1:
        return first
    dst, src = first.dst, first.src
    return first._replace(dst=dst._replace(shape=(len(run), *dst.shape), stride=(dst_step, *dst.stride)),
                          src=src._replace(shape=(len(run), *src.shape), stride=(src_step, *src.stride)))


def coalesce_layouts(pairs: Sequence[tuple[Strided, Strided]]) -> list[Merged]:
    """:func:`coalesce` on layouts: (destination, source) copies batched into as few copies as possible,
    each :class:`Merged` naming the first of the ``pairs`` it covers (the tensors to make its views of)."""
    ordered = sorted((Merged(dst, src, i) for i, (dst, src) in enumerate(pairs) if dst.numel),
                     key=lambda m: (m.dst.storage, m.dst.address))
    merged: list[Merged] = []
    for pair in ordered:
        joined = _merge(merged[-1], pair) if merged else None
        if joined is not None:
            merged[-1] = joined
        else:
            merged.append(pair)
    out: list[Merged] = []
    run: list[Merged] = []
    steps = (0, 0)
    for pair in merged:
        if run and _same_layout(run[-1].dst, pair.dst) and _same_layout(run[-1].src, pair.src):
            step = (_step(run[-1].dst, pair.dst), _step(run[-1].src, pair.src))
            if all(step) and (len(run) == 1 or step == steps):
                run.append(pair)
                steps = step
                continue
        if run:
            out.append(_stack(run, steps))
        run, steps = [pair], (0, 0)
    if run:
        out.append(_stack(run, steps))
    return out


def coalesce(pairs: Sequence[Pair]) -> list[Pair]:
    """(destination, source) copies batched into as few copies as possible, exactly the same bytes.

    Copies are taken in destination memory order. Neighbours in memory on both sides merge into one
    flat copy (``[gate_e; up_e]`` of every expert: one copy per stacked tensor) or into one copy along
    the dimension they continue (``w13[:, :I]`` and ``w13[:, I:]`` from ``fc1[:, :I]`` and
    ``fc1[:, I:]``); then runs of equal-layout copies at constant distances on both sides become one
    strided copy (Megatron's per-group ``q``/``k``/``v`` blocks: one copy each per layer).
    Destinations never overlap, so a merged view covers exactly the bytes of the copies it replaces.
    """
    merged = coalesce_layouts([(Strided.of(dst), Strided.of(src)) for dst, src in pairs])
    return [m.views(*pairs[m.first]) for m in merged]


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
