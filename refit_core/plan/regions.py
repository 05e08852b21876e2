"""Finding the boxes that overlap a query box without comparing against every box."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate

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


def first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two boxes of ``boxes`` that overlap (the first found, in index order), or None."""
    index = BoxIndex(boxes)
    for i, box in enumerate(boxes):
        for j, _ in index.overlapping(box):
            if j != i:
                return (boxes[min(i, j)], boxes[max(i, j)])
    return None
