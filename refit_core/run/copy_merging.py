"""Many copies made few before they run: neighbours merged, equal blocks stacked, words widened.

:func:`coalesce` merges copies that are neighbours in memory on both sides (flat, or along a dimension)
and stacks runs of equal-layout copies at constant distances into one strided copy; :func:`widen` moves
a same-dtype copy as the same bytes in the widest integer words both views allow. Both keep exactly the
same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view), equal shapes

_WORDS = (torch.int64, torch.int32, torch.int16)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def view_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts where contiguous ``a`` ends, in the same storage and dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous() and _storage(a) == _storage(b)
            and b.data_ptr() == a.data_ptr() + view_nbytes(a))


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
