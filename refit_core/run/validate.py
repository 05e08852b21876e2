"""Checks of the local views a rank hands to refit, run at setup and again whenever views are bound.

A piece is checked when it is built, but a plugin may hand out views that changed afterwards (a
parameter re-materialized, a dtype swapped, a tensor resized). Binding re-checks every view, before
any byte moves: the right shape and dtype, one device, no stride-0 dimension in a destination (two
elements sharing memory), and no two destination views sharing memory (one tensor's bytes would
overwrite another's).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.spec import Box, TensorSpec


class ViewError(RefitError):
    """A local view does not match its piece, or destination views overlap."""


def check_view(spec: TensorSpec, box: Box, view: object, *, destination: bool, placeholder: bool = False) -> None:
    """One view against its piece: a tensor of ``box.sizes`` and ``spec.dtype``, writable if a destination.

    ``placeholder``: a gen rank's setup-time view, which the hookspec allows to be a placeholder (right
    shape, dtype and device, not writable, e.g. an expanded scalar): only shape and dtype are checked;
    the views bound for a step get the full check.
    """
    if not isinstance(spec.name, str):
        raise ViewError(f"a piece's tensor name {spec.name!r:.60} is not a string")
    if not isinstance(view, torch.Tensor):
        raise ViewError(f"{spec.name}: the view is a {type(view).__name__}, not a tensor")
    if tuple(view.shape) != box.sizes:
        raise ViewError(f"{spec.name}: view shape {tuple(view.shape)} != box sizes {box.sizes} "
                        "(the view changed after the piece was built?)")
    if view.dtype != spec.dtype:
        raise ViewError(f"{spec.name}: view dtype {view.dtype} != spec dtype {spec.dtype} "
                        "(the view changed after the piece was built?)")
    if placeholder:
        return
    if any(st == 0 and n > 1 for st, n in zip(view.stride(), view.shape)):
        raise ViewError(f"{spec.name}: view has a stride-0 dimension (strides {view.stride()}): several "
                        "elements share one memory location (an expanded tensor, not the weights)")
    if destination and view.is_meta:
        raise ViewError(f"{spec.name}: destination view is on the meta device (no memory to write)")


def _span(view: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last byte address a view touches."""
    size = view.element_size()
    last = sum((n - 1) * st for n, st in zip(view.shape, view.stride()) if n > 0)
    return view.data_ptr(), view.data_ptr() + (last + 1) * size


def check_no_overlap(names: Sequence[str], views: Sequence[torch.Tensor]) -> None:
    """No two destination views may share a byte (checked exactly where their spans interleave)."""
    by_storage: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, view in enumerate(views):
        if view.numel():
            by_storage[(str(view.device), view.untyped_storage().data_ptr())].append(i)
    for members in by_storage.values():
        spans = sorted((*_span(views[i]), i) for i in members)
        cluster: list[int] = []
        cluster_end = -1
        for lo, hi, i in [*spans, (1 << 62, 1 << 62, -1)]:
            if lo >= cluster_end:  # the previous cluster of interleaving spans is complete
                if len(cluster) > 1:
                    _check_cluster(names, views, cluster)
                cluster, cluster_end = [], hi
            cluster.append(i)
            cluster_end = max(cluster_end, hi)


BLOCKS_AT_MOST = 1 << 20
"""Contiguous blocks a cluster's views may be cut into for the fast check; past that, bytes are counted."""


def _blocks(view: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """The view as equal contiguous blocks: the ``(size, stride)`` of the dimensions outside its innermost
    contiguous block, and that block's length (elements)."""
    dims = [(n, st) for n, st in zip(view.shape, view.stride()) if n > 1]
    block = 1
    while dims and dims[-1][1] == block:
        block *= dims.pop()[0]
    return dims, block


def _disjoint(views: Sequence[torch.Tensor], members: list[int]) -> bool | None:
    """Whether the members' views share no byte, none with itself included (exact: their contiguous blocks,
    sorted, never start before an earlier one ends); None if that is too many blocks to list."""
    layouts = [_blocks(views[i]) for i in members]
    if sum(math.prod(n for n, _ in dims) for dims, _ in layouts) > BLOCKS_AT_MOST:
        return None
    starts, ends = [], []
    for i, (dims, block) in zip(members, layouts):
        first = torch.zeros(1, dtype=torch.int64)
        for n, st in dims:
            first = (first[:, None] + torch.arange(n, dtype=torch.int64) * st).flatten()
        size = views[i].element_size()
        first = first * size + views[i].data_ptr()
        starts.append(first)
        ends.append(first + block * size)
    start, order = torch.cat(starts).sort()
    end = torch.cat(ends)[order]
    return bool((start[1:] >= end[:-1].cummax(0).values).all())


def _check_cluster(names: Sequence[str], views: Sequence[torch.Tensor], members: list[int]) -> None:
    """Prove the cluster's views disjoint from their contiguous blocks; else (they overlap, or are cut in too
    many blocks) count, per byte of the cluster's span, the views covering it (addresses only, any device)."""
    if _disjoint(views, members):
        return
    lo = min(_span(views[i])[0] for i in members)
    hi = max(_span(views[i])[1] for i in members)
    counts = torch.zeros(hi - lo, dtype=torch.uint8)
    for k, i in enumerate(members):
        view = views[i]
        size = view.element_size()
        cover = counts.as_strided((*view.shape, size), (*(st * size for st in view.stride()), 1),
                                  view.data_ptr() - lo)
        try:
            cover += 1
        except RuntimeError:
            raise ViewError(f"the destination view of {names[i]} overlaps itself") from None
        if int(counts.max()) > 1:
            earlier = ", ".join(names[j] for j in members[:k])
            raise ViewError(f"the destination view of {names[i]} shares memory with that of {earlier[:300]}: "
                            "one tensor's bytes would overwrite the other's")
