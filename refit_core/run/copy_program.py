"""A colocated receiver's copies resolved once into the fewest launches, run every step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from refit_core.contract.options import StridedCopy
from refit_core.run import triton_copies
from refit_core.run.copy_merging import Pair, coalesce, view_nbytes, widen
from refit_core.run.strided_copies import MIN_BLOCK_BYTES, blocks, memcpy2d_launch, pitched

BATCH_BELOW = 8 << 20
"""Copies smaller than this join a multi-tensor batch: below it, one launch for many small copies beats a
device memcpy launch each (the measurements: ../shared/DESIGN.md)."""


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
            if view_nbytes(wide_dst) >= batch_below:
                (dense_singles if dense else strided_singles).append((wide_dst, wide_src))
            else:
                dsts, srcs = batches.setdefault((wide_dst.dtype, wide_src.dtype, dense), ([], []))
                dsts.append(wide_dst)
                srcs.append(wide_src)
        dense_singles.sort(key=lambda p: view_nbytes(p[0]), reverse=True)  # the device is busy at once
        strided_singles.sort(key=lambda p: view_nbytes(p[0]), reverse=True)
        self._groups: dict[str, list[Callable[[], None]]] = {
            "contiguous": [_copy(d, s) for d, s in dense_singles],
            "strided": self._strided_launches(strided_singles, min_block_bytes),
            "batched": [_foreach(d, s) for d, s in batches.values()],
        }
        self.counts = CopyCounts(segments=len(pairs), copies=len(merged),
                                 launches=sum(len(g) for g in self._groups.values()),
                                 batched=sum(len(d) for d, _ in batches.values()), strided=strided_count,
                                 widened=widened, strided_bytes=sum(view_nbytes(d) for d, _ in strided_singles))

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
                    launches.append(memcpy2d_launch(shape, dst.device))
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
