"""Every large strided copy of a colocated step in one Triton launch (CUDA): :attr:`StridedCopy.TRITON`.

A copy qualifies when both views are ``[G, R, C]`` (or ``[R, C]``) stacks of rows that are contiguous
on both sides, in the same integer word (:func:`~refit_core.run.copies.widen` made them so): Megatron's
per-group ``q`` / ``k`` / ``v`` rows into vLLM's ``[Q; K; V]``. The launch has one program per tile of
``TILE_ROWS x TILE_WORDS`` words; a per-tile ``int32`` index names its copy, whose row in an ``int64``
table holds both views' offsets (in words from one anchor tensor, so that Triton can prove alignment
and move 16-byte vectors) and strides, the extent and the first tile. The tables are built once, at
bind time; a step is one launch whatever the number of copies. torch's strided copy kernel and its
multi-tensor copy move these rows at about 0.7 of the device's copy rate; whole-row tiles move them
at the rate of a plain copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: StridedCopy.TRITON falls back to the multi-tensor copy
    triton = None

Pair = tuple[torch.Tensor, torch.Tensor]

FIELDS = 11
"""Per-copy table row: source offset and strides along G and R; destination offset and strides along G
and R (words from the anchor); R, C; tiles along R and C; first tile."""
TILE_ROWS = 4
TILE_WORDS = 1024
"""A tile: this many rows of this many 8-byte words (32 KiB), one program."""


def available(device: torch.device) -> bool:
    """True if the batched Triton copy can run on ``device`` (CUDA, with Triton installed)."""
    return triton is not None and device.type == "cuda"


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[G, R, C]`` with unit stride along C; None if it is not a stack of rows."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.stride(-1) != 1 or t.dtype != torch.int64:
        return None
    return t


def qualifies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the batched launch can move ``(dst, src)``: int64 words, rows contiguous on both sides."""
    return (dst.dtype == src.dtype and dst.device == src.device and available(dst.device)
            and _as_rows(dst) is not None and _as_rows(src) is not None)


class TritonCopies:
    """``pairs`` (each :func:`qualifies`) as one launch per alignment class; :meth:`launches` runs them."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        if not pairs:
            raise ValueError("TritonCopies needs at least one copy")
        device = pairs[0][0].device
        self.anchor = torch.zeros(2, dtype=torch.int64, device=device)  # 16-byte aligned (an allocation)
        base = self.anchor.data_ptr()
        groups: dict[bool, tuple[list[list[int]], list[int]]] = {}
        for dst, src in pairs:
            d, s = _as_rows(dst), _as_rows(src)
            if d is None or s is None or d.shape != s.shape:
                raise ValueError(f"not a stack of contiguous rows: {tuple(dst.shape)} {dst.stride()}")
            g, r, c = d.shape
            d_off, s_off = (d.data_ptr() - base) // 8, (s.data_ptr() - base) // 8
            if (d.data_ptr() - base) % 8 or (s.data_ptr() - base) % 8:
                raise ValueError("a copy's addresses are not 8-byte words")
            numbers = (s_off, s.stride(0), s.stride(1), d_off, d.stride(0), d.stride(1), c)
            aligned = all(n % 2 == 0 for n in numbers)  # every row starts on a 16-byte boundary
            tiles_r, tiles_c = -(-r // TILE_ROWS), -(-c // TILE_WORDS)
            rows, owners = groups.setdefault(aligned, ([], []))
            first = len(owners)
            rows.append([s_off, s.stride(0), s.stride(1), d_off, d.stride(0), d.stride(1), r, c, tiles_r, tiles_c,
                         first])
            owners += [len(rows) - 1] * (g * tiles_r * tiles_c)
        self._launches = [
            (torch.tensor(rows, dtype=torch.int64, device=device),
             torch.tensor(owners, dtype=torch.int32, device=device), aligned)
            for aligned, (rows, owners) in groups.items()]
        self._warm_up(device)

    def _warm_up(self, device: torch.device) -> None:
        """Compile each launch's kernel now (at bind time), not in the first step, where the trainer
        would wait for it: one tile that copies the anchor's two words onto themselves."""
        table = torch.tensor([[0, 0, 2, 0, 0, 2, 1, 2, 1, 1, 0]], dtype=torch.int64, device=device)
        owners = torch.zeros(1, dtype=torch.int32, device=device)
        for _, _, aligned in self._launches:
            self._launch(table, owners, aligned)()

    @property
    def count(self) -> int:
        """Launches per step."""
        return len(self._launches)

    def launches(self) -> list[Callable[[], None]]:
        """One callable per launch (queued on the current stream)."""
        return [self._launch(table, owners, aligned) for table, owners, aligned in self._launches]

    def _launch(self, table: torch.Tensor, owners: torch.Tensor, aligned: bool) -> Callable[[], None]:
        anchor, tiles = self.anchor, owners.numel()

        def launch() -> None:
            _copy_tiles[(tiles,)](table, owners, anchor, TILE_ROWS=TILE_ROWS, TILE_WORDS=TILE_WORDS, WIDTH=FIELDS,
                                  ALIGNED=aligned, num_warps=8)
        return launch


_copy_tiles: Any = None

if triton is not None:
    @triton.jit
    def _copy_tiles_kernel(table, owners, anchor, TILE_ROWS: tl.constexpr, TILE_WORDS: tl.constexpr,
                           WIDTH: tl.constexpr, ALIGNED: tl.constexpr):
        tile = tl.program_id(0).to(tl.int64)
        row = table + tl.load(owners + tile).to(tl.int64) * WIDTH
        src_offset, src_g, src_r = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        dst_offset, dst_g, dst_r = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
        n_rows, n_cols = tl.load(row + 6), tl.load(row + 7)
        tiles_r, tiles_c = tl.load(row + 8), tl.load(row + 9)
        local = tile - tl.load(row + 10)
        col0 = (local % tiles_c) * TILE_WORDS
        row0 = ((local // tiles_c) % tiles_r) * TILE_ROWS
        group = local // (tiles_c * tiles_r)
        src_start = src_offset + group * src_g + row0 * src_r + col0
        dst_start = dst_offset + group * dst_g + row0 * dst_r + col0
        if ALIGNED:
            src_start = tl.multiple_of(src_start, 2)
            dst_start = tl.multiple_of(dst_start, 2)
            src_r = tl.multiple_of(src_r, 2)
            dst_r = tl.multiple_of(dst_r, 2)
            n_cols = tl.multiple_of(n_cols, 2)
        rr = tl.arange(0, TILE_ROWS)[:, None]
        cc = tl.arange(0, TILE_WORDS)[None, :]
        sources = anchor + src_start + rr * src_r + cc
        targets = anchor + dst_start + rr * dst_r + cc
        if (row0 + TILE_ROWS <= n_rows) & (col0 + TILE_WORDS <= n_cols):
            tl.store(targets, tl.load(sources))
        else:
            inside = (row0 + rr < n_rows) & (col0 + cc < n_cols)
            tl.store(targets, tl.load(sources, mask=inside), mask=inside)

    _copy_tiles = _copy_tiles_kernel


__all__ = ["FIELDS", "TILE_ROWS", "TILE_WORDS", "TritonCopies", "available", "qualifies"]
