"""Which bytes of memory a set of views touches: overlap between destination views, and coverage.

Two destination views that share a byte would be written twice per step (torn or order-dependent
weights); a parameter byte no view covers would never be refitted. Meant for the small models of
tests: it enumerates every element's address.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ByteRun:
    """The bytes of one tensor inside its storage, as sorted byte offsets."""

    storage: tuple[str, int]
    offsets: torch.Tensor


def byte_offsets(tensor: torch.Tensor) -> ByteRun:
    """Every byte ``tensor`` addresses, as offsets into its storage (duplicates kept)."""
    index = torch.tensor([tensor.storage_offset()], dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        index = (index.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    itemsize = tensor.element_size()
    start = index * itemsize
    data = (start.unsqueeze(-1) + torch.arange(itemsize, dtype=torch.int64)).reshape(-1)
    storage = tensor.untyped_storage()
    return ByteRun((str(tensor.device), storage.data_ptr()), data)


def overlapping_views(names: Sequence[str], views: Sequence[torch.Tensor]) -> list[str]:
    """Pairs of views (by name) that share bytes, and views that address a byte twice themselves."""
    by_storage: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = defaultdict(list)
    problems: list[str] = []
    for i, view in enumerate(views):
        if view.numel() == 0:
            continue
        run = byte_offsets(view)
        if run.offsets.unique().numel() != run.offsets.numel():
            problems.append(f"{names[i]}: its view addresses some bytes more than once (zero or overlapping strides)")
        by_storage[run.storage].append((i, run.offsets.unique()))
    for runs in by_storage.values():
        if len(runs) < 2:
            continue
        owners = torch.cat([torch.full_like(offsets, i) for i, offsets in runs])
        offsets = torch.cat([offsets for _, offsets in runs])
        order = torch.argsort(offsets, stable=True)
        offsets, owners = offsets[order], owners[order]
        same = (offsets[1:] == offsets[:-1]).nonzero().flatten()
        pairs = sorted({(int(owners[k]), int(owners[k + 1])) for k in same.tolist()})
        problems += [f"{names[a]} and {names[b]}: their views share memory" for a, b in pairs]
    return problems


def uncovered(parameters: dict[str, torch.Tensor], views: Sequence[torch.Tensor]) -> list[str]:
    """Parameters (by name) with bytes that no view writes."""
    written: dict[tuple[str, int], torch.Tensor] = defaultdict(lambda: torch.empty(0, dtype=torch.int64))
    for view in views:
        if view.numel():
            run = byte_offsets(view)
            written[run.storage] = torch.cat([written[run.storage], run.offsets])
    problems = []
    for name, param in parameters.items():
        if param.numel() == 0:
            continue
        run = byte_offsets(param)
        missing = ~torch.isin(run.offsets, written[run.storage])
        if missing.any():
            problems.append(f"{name}: {int(missing.sum()) // param.element_size()} of {param.numel()} elements "
                            "are written by no destination view")
    return problems
