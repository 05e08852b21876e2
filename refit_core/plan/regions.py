"""Regions of one logical tensor: finding overlapping boxes, and the matching steps both planners share.

:class:`BoxIndex` finds the boxes that overlap a query box without comparing against every box, and is
the one overlap finder of refit (:func:`first_overlap`). The reference planner
(:mod:`refit_core.plan.reference`) and the fast planner (:mod:`refit_core.plan.fast`) match a tensor's
destination pieces to its source regions with the steps below: :func:`source_regions` (identical
replicas merged, overlaps refused), :func:`check_destinations`, and :func:`covering_slabs` (each
destination piece cut into the slabs its regions serve, replicated regions split so every replica takes
a share).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from refit_core.contract.errors import PlanError
from refit_core.contract.spec import Box


class BoxIndex:
    """A sweep index over boxes of one tensor.

    Boxes are sorted by their start on the dimension where they differ most (the one sharding cut),
    with a running maximum of their ends; a query bisects to the candidates that can overlap and
    checks only those. Sharded layouts cut few dimensions, so queries touch few boxes.
    """

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.boxes = list(boxes)
        ndim = self.boxes[0].ndim if self.boxes else 0
        spread = [len({b.offsets[d] for b in self.boxes}) for d in range(ndim)]
        self.dim = max(range(ndim), key=lambda d: spread[d]) if ndim else 0
        self.order = sorted(range(len(self.boxes)), key=lambda i: self._start(self.boxes[i]))
        self.starts = [self._start(self.boxes[i]) for i in self.order]
        self.max_ends = list(accumulate((self._end(self.boxes[i]) for i in self.order), max))

    def _start(self, box: Box) -> int:
        return box.offsets[self.dim] if box.ndim else 0

    def _end(self, box: Box) -> int:
        return box.ends[self.dim] if box.ndim else 1

    def separated(self) -> bool:
        """True when no two boxes share a point on the sweep dimension (so none overlap at all);
        False says nothing either way."""
        return all(start >= end for start, end in zip(self.starts[1:], self.max_ends))

    def overlapping(self, query: Box) -> list[tuple[int, Box]]:
        """``(index, intersection)`` of every indexed box that overlaps ``query``, in index order."""
        lo = bisect.bisect_right(self.max_ends, self._start(query))
        hi = bisect.bisect_left(self.starts, self._end(query))
        found = []
        for i in self.order[lo:hi]:
            common = self.boxes[i].intersect(query)
            if common is not None:
                found.append((i, common))
        found.sort(key=lambda item: item[0])
        return found

    def first_overlap(self) -> tuple[int, int] | None:
        """The indices ``(i, j)``, ``i < j``, of the first two indexed boxes that overlap (lowest ``i``,
        then lowest ``j``), or None when no two do."""
        if self.separated():
            return None
        for i, box in enumerate(self.boxes):
            for j, _ in self.overlapping(box):
                if j > i:
                    return i, j
        return None


def first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two boxes of ``boxes`` that overlap (the first found, in index order), or None."""
    pair = BoxIndex(boxes).first_overlap()
    return None if pair is None else (boxes[pair[0]], boxes[pair[1]])


@dataclass(frozen=True)
class Holder:
    """Piece ``piece`` of side-local rank ``rank`` holds ``box`` of a logical tensor."""

    rank: int
    piece: int
    box: Box


@dataclass
class SourceRegion:
    """A box of a logical tensor and the train ranks' pieces holding it (identical replicas)."""

    box: Box
    holders: list[Holder]


def source_regions(name: str, holders: Sequence[Holder]) -> tuple[list[SourceRegion], BoxIndex]:
    """Tensor ``name``'s non-empty source boxes, replicas of one box merged into one region (sorted by
    offsets, then sizes), and an index over them; a :class:`PlanError` where two different boxes overlap."""
    by_box: dict[Box, SourceRegion] = {}
    for holder in holders:
        if holder.box.numel:
            by_box.setdefault(holder.box, SourceRegion(holder.box, [])).holders.append(holder)
    regions = sorted(by_box.values(), key=lambda r: (r.box.offsets, r.box.sizes))
    index = BoxIndex([r.box for r in regions])
    pair = index.first_overlap()
    if pair is not None:
        a, b = regions[pair[0]], regions[pair[1]]
        raise PlanError(f"{name}: source boxes {a.box} (train ranks {[h.rank for h in a.holders]}) and "
                        f"{b.box} (train ranks {[h.rank for h in b.holders]}) overlap without being "
                        "replicas of each other")
    return regions, index


def check_destinations(name: str, pieces: Sequence[Holder]) -> None:
    """A :class:`PlanError` where two destination pieces of tensor ``name`` on one gen rank overlap."""
    by_rank: dict[int, list[Box]] = defaultdict(list)
    for piece in pieces:
        by_rank[piece.rank].append(piece.box)
    for rank, boxes in by_rank.items():
        pair = first_overlap(boxes)
        if pair is not None:
            raise PlanError(f"{name}: destination boxes {pair[0]} and {pair[1]} overlap on gen rank {rank}")


def split_rows(box: Box, parts: int, align: int = 1) -> list[Box]:
    """Cut a box into up to ``parts`` slabs along its first dimension, at multiples of ``align`` rows."""
    rows = box.sizes[0]
    parts = max(1, min(parts, rows // align))
    cuts = [rows * i // parts // align * align for i in range(parts)] + [rows]
    return [Box((box.offsets[0] + a, *box.offsets[1:]), (b - a, *box.sizes[1:]))
            for a, b in zip(cuts, cuts[1:]) if b > a]


def readers_per_region(regions: int, overlaps: Sequence[Sequence[tuple[int, Box]]]) -> list[int]:
    """How many destination pieces read each source region (``overlaps``: per piece, ``(region, box)``)."""
    readers = [0] * regions
    for found in overlaps:
        for i, _ in found:
            readers[i] += 1
    return readers


def slab_count(replicas: int, readers: int) -> int:
    """Slabs each reader's part of a large replicated region is cut into: enough that the region's
    readers together make one row per replica (``ceil(replicas / readers)``), so every replica can
    take a share; where readers outnumber replicas, whole parts already spread over the replicas."""
    return -(-replicas // max(readers, 1))


def covering_slabs(name: str, dst: Holder, found: Sequence[tuple[int, Box]], regions: Sequence[SourceRegion],
                   readers: Sequence[int], item: int, balance_split_bytes: int, rows: int = 1) -> list[tuple[int, Box]]:
    """``(region, slab)`` for every slab of destination piece ``dst`` (absolute boxes), from ``found``
    (its ``(region, intersection)`` pairs, :meth:`BoxIndex.overlapping`); a :class:`PlanError` where the
    regions leave part of it uncovered.

    An intersection of at least ``balance_split_bytes`` (``item`` bytes an element) with a region of
    several replicas is cut into :func:`slab_count` slabs, at multiples of ``rows`` rows (a quantization
    block's), so the replicas can share it.
    """
    slabs: list[tuple[int, Box]] = []
    covered = 0
    for i, common in found:
        covered += common.numel
        parts = slab_count(len(regions[i].holders), readers[i]) if common.numel * item >= balance_split_bytes else 1
        if parts > 1:
            slabs.extend((i, slab) for slab in split_rows(common, parts, rows))
        else:
            slabs.append((i, common))
    if covered != dst.box.numel:
        raise PlanError(f"{name}: {dst.box.numel - covered} of {dst.box.numel} elements of box "
                        f"{dst.box} on gen rank {dst.rank} are held by no train rank")
    return slabs


__all__ = ["BoxIndex", "Holder", "SourceRegion", "check_destinations", "covering_slabs", "first_overlap",
           "readers_per_region", "slab_count", "source_regions", "split_rows"]
