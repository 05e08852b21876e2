"""The copies between a round's local views and a staging buffer of its layout, planned once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit_core.run.copy_merging import coalesce, view_nbytes, widen
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
            if view_nbytes(dst) >= batch_below:
                self.singles.append((view, layout))
            else:
                views, layouts = self.batches.setdefault((dst.dtype, src.dtype), ([], []))
                views.append(view)
                layouts.append(layout)
        self.singles.sort(key=lambda p: view_nbytes(p[0]), reverse=True)

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
