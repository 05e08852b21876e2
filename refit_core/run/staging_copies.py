"""The copies between a round's local views and a staging buffer of its layout, planned once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from refit_core.run.contiguous_runs import ContiguousRuns, RunCopy, runnable
from refit_core.run.copy_merging import Pair, Strided, coalesce, coalesce_layouts, view_nbytes, widen
from refit_core.run.copy_program import BATCH_BELOW


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
    Megatron's per-query-group ``k`` / ``v`` blocks and their FP8 scales is thousands of segments). Small
    contiguous copies of consecutive segments run as one call per run (:mod:`~refit_core.run.contiguous_runs`).
    """

    def __init__(self, local: Sequence[torch.Tensor], staged: Sequence[torch.Tensor], *, into_buffer: bool,
                 batch_below: int = BATCH_BELOW) -> None:
        self.into_buffer = into_buffer
        small = [runnable(v, s) and view_nbytes(v) < batch_below for v, s in zip(local, staged)]
        self._runs_of([RunCopy(v, int(s.storage_offset()) * s.element_size())
                       for v, s, run in zip(local, staged, small) if run])
        pairs = [(s, v) if into_buffer else (v, s) for v, s, run in zip(local, staged, small) if not run]
        self._group(coalesce(pairs), batch_below)

    @classmethod
    def of_layouts(cls, local: Sequence[Strided], views: Sequence[torch.Tensor], layouts: Sequence[Strided],
                   template: torch.Tensor, *, into_buffer: bool, batch_below: int = BATCH_BELOW) -> StagingCopies:
        """The same copies, planned from layouts: ``local[i]`` the layout of local view ``views[i]``,
        ``layouts[i]`` of a view of ``template`` (its storage's); no staged view is made but those of the
        merged copies."""
        copies = cls.__new__(cls)
        copies.into_buffer = into_buffer
        small = [v.dtype == s.dtype and v.contiguous and s.contiguous and v.numel * v.itemsize < batch_below
                 for v, s in zip(local, layouts)]  # what :func:`runnable` says of their views
        copies._runs_of([RunCopy(view, s.offset * s.itemsize) for view, s, run in zip(views, layouts, small) if run])
        typed: dict[torch.dtype, torch.Tensor] = {}

        def buffer_of(dtype: torch.dtype) -> torch.Tensor:
            if dtype not in typed:
                typed[dtype] = template.view(dtype)
            return typed[dtype]

        kept = [i for i, run in enumerate(small) if not run]
        pairs = [(layouts[i], local[i]) if into_buffer else (local[i], layouts[i]) for i in kept]
        merged = []
        for m in coalesce_layouts(pairs):
            first = kept[m.first]
            local_base, staged_base = views[first], buffer_of(layouts[first].dtype)
            merged.append(m.views(staged_base, local_base) if into_buffer else m.views(local_base, staged_base))
        copies._group(merged, batch_below)
        return copies

    def _runs_of(self, copies: Sequence[RunCopy]) -> None:
        """The small contiguous copies, moved as runs (:class:`ContiguousRuns`)."""
        self.runs = ContiguousRuns(copies, into_buffer=self.into_buffer)

    def _group(self, merged: Iterable[Pair], batch_below: int) -> None:
        """Widen the merged copies and group them: large ones alone (largest first), the rest per dtype pair."""
        self.singles: list[tuple[torch.Tensor, BufferView]] = []
        self.batches: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[BufferView]]] = {}
        for dst, src in merged:
            dst, src = widen(dst, src)
            view, staged_view = (src, dst) if self.into_buffer else (dst, src)
            layout = BufferView.of_view(staged_view)
            if view_nbytes(dst) >= batch_below:
                self.singles.append((view, layout))
            else:
                views, layouts = self.batches.setdefault((dst.dtype, src.dtype), ([], []))
                views.append(view)
                layouts.append(layout)
        self.singles.sort(key=lambda p: view_nbytes(p[0]), reverse=True)

    @property
    def launches(self) -> int:
        return len(self.singles) + len(self.batches) + self.runs.launches

    def run(self, buffer: torch.Tensor) -> None:
        self.runs.run(buffer)
        for view, layout in self.singles:
            staged = layout.on(buffer)
            (staged.copy_(view) if self.into_buffer else view.copy_(staged))
        for views, layouts in self.batches.values():
            staged_views = [layout.on(buffer) for layout in layouts]
            if self.into_buffer:
                torch._foreach_copy_(staged_views, views)
            else:
                torch._foreach_copy_(views, staged_views)
