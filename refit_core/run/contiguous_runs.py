"""Small contiguous copies into or out of consecutive segments of a staging buffer, one call per run.

A staged round of many small tensors (a LoRA adapter step: two tensors per adapted module, 448 for the
Llama-3-8B shape) paid Python work per segment at every step: a typed view of the buffer for each, then one
multi-tensor copy of them all. Here the copies whose local view is contiguous and of the wire dtype, and
whose segments follow each other in the buffer (only alignment padding between them), form a *run*: the
sender packs a run with one ``torch.cat(..., out=)`` into the run's span of the buffer, the receiver unpacks
it with one ``torch.split_with_sizes_copy``. The local views are flattened into integer words once, at
construction; a step makes one view of the buffer per run. Padding is written as zeros (sender) or read into
a scratch tensor (receiver): it is never a weight's byte, since every segment starts 16-byte aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit_core.plan.items import ALIGN

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True)
class RunCopy:
    """One copy of a run: ``local`` (a contiguous view, the wire's dtype) and the byte ``offset`` of its
    segment in the staging buffer."""

    local: torch.Tensor
    offset: int

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


@dataclass(frozen=True)
class _Run:
    """Consecutive segments ``[start, end)`` of the buffer moved as ``word``: the local words and the
    padding between them, in buffer order, with their sizes in words."""

    start: int
    end: int
    word: torch.dtype
    parts: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...]


def runnable(local: torch.Tensor, staged: torch.Tensor) -> bool:
    """Whether the copy between ``local`` and its staged view ``staged`` can join a run."""
    return local.dtype == staged.dtype and local.is_contiguous() and staged.is_contiguous()


class ContiguousRuns:
    """Copies between local views and the consecutive segments of any staging buffer of one layout, planned
    once: ``into_buffer`` packs (sender), else unpacks (receiver). See the module doc."""

    def __init__(self, copies: Sequence[RunCopy], *, into_buffer: bool) -> None:
        self.into_buffer = into_buffer
        self.copies = len(copies)
        self._zeros: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        ordered = sorted((c for c in copies if c.nbytes), key=lambda c: c.offset)
        groups: list[list[RunCopy]] = []
        for copy in ordered:
            last = groups[-1][-1] if groups else None
            if last is not None and 0 <= copy.offset - (last.offset + last.nbytes) < ALIGN \
                    and copy.local.device == last.local.device:
                groups[-1].append(copy)
            else:
                groups.append([copy])
        self._runs = [self._run(group) for group in groups]

    @property
    def launches(self) -> int:
        """Copy calls per step: one per run."""
        return len(self._runs)

    def _run(self, group: list[RunCopy]) -> _Run:
        start, end = group[0].offset, group[-1].offset + group[-1].nbytes
        edges = [start, end] + [c.offset for c in group] + [c.nbytes for c in group]
        addresses = [c.local.data_ptr() for c in group]
        word = next(w for w in _WORDS if all(e % w.itemsize == 0 for e in edges + addresses))
        parts: list[torch.Tensor] = []
        sizes: list[int] = []
        at = start
        for copy in group:
            if copy.offset > at:
                parts.append(self._pad((copy.offset - at) // word.itemsize, word, copy.local.device))
                sizes.append(parts[-1].numel())
            parts.append(copy.local.reshape(-1).view(torch.uint8).view(word))
            sizes.append(parts[-1].numel())
            at = copy.offset + copy.nbytes
        return _Run(start, end, word, tuple(parts), tuple(sizes))

    def _pad(self, words: int, word: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeros the sender writes into padding (shared by equal gaps), or a scratch tensor of its own that
        the receiver reads a gap into (outputs of one call must not alias)."""
        if not self.into_buffer:
            return torch.empty(words, dtype=word, device=device)
        key = (words, word, device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(words, dtype=word, device=device)
        return self._zeros[key]

    def run(self, buffer: torch.Tensor) -> None:
        """Pack every run into ``buffer`` (a flat ``uint8`` staging buffer of the layout), or unpack it."""
        for run in self._runs:
            span = buffer[run.start:run.end].view(run.word)
            if self.into_buffer:
                torch.cat(run.parts, out=span)
            else:
                torch.split_with_sizes_copy(span, list(run.sizes), out=list(run.parts))


__all__ = ["ContiguousRuns", "RunCopy", "runnable"]
