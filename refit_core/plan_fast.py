"""The planner's fast path: the reference planner's transfers, exploiting the layouts' regularity.

Layouts are regular: the same tensor of every layer is cut the same way on both sides (the same
ranks hold the same boxes), only its name and its pieces' local indices differ. This planner groups
logical tensors by that *signature* (shape, dtype and every ``(rank, box)`` of both sides, in order),
matches one representative per group with the reference planner's own steps
(:mod:`refit_core.planner`), and stamps the result across the group, renaming pieces; the boxes of
the stamped transfers are shared objects. Replica choice (largest region first, to the least-loaded
replica) runs over all regions at once in numpy where a region has one holder; only regions held by
several replicas take a Python step each.

The result equals :func:`refit_core.planner.plan_transfers`' transfer for transfer (same order, same
sources), so schedules and fingerprints are the same (``tests/scale/test_plan_fast.py``); errors are
the reference planner's, raised for the same first tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import PlanError
from .options import CastPolicy
from .pieces import PieceMeta
from .planner import Transfer, _check_destinations, _Holder, _source_regions, _split_rows, check_specs
from .spec import Box, TensorSpec, dtype_size


@dataclass
class _Tensor:
    """One logical tensor's pieces on one side, in rank and piece order (parallel lists)."""

    spec: TensorSpec
    ranks: list[int]
    pieces: list[int]
    boxes: list[Box]

    def key(self) -> tuple:
        return (tuple(self.ranks), tuple(self.boxes))


@dataclass(frozen=True)
class _Match:
    """A representative tensor's matched regions: row ``i`` moves ``src_boxes[i]`` of a source region
    (held at positions ``holders[region[i]]`` of the tensor's source list) into ``dst_boxes[i]`` of the
    piece at position ``dst_pos[i]`` of its destination list (boxes relative to the pieces)."""

    dst_pos: list[int]
    region: list[int]
    src_boxes: list[Box]
    dst_boxes: list[Box]
    nbytes: np.ndarray
    holders: list[list[int]]
    fixed: np.ndarray
    """Per row: the only holder's position, or -1 when the region has replicas."""


def _side(side: str, ranks: Sequence[Sequence[PieceMeta]]) -> dict[str, _Tensor]:
    """Every logical tensor of one side; the reference planner's spec agreement check on the way."""
    out: dict[str, _Tensor] = {}
    for rank, metas in enumerate(ranks):
        for index, meta in enumerate(metas):
            spec = meta.spec
            entry = out.get(spec.name)
            if entry is None:
                entry = out[spec.name] = _Tensor(spec, [], [], [])
            elif entry.spec is not spec and entry.spec != spec:
                known = entry.spec
                raise PlanError(f"{side} ranks disagree on {spec.name}: {known.shape} {known.dtype} "
                                f"vs {spec.shape} {spec.dtype} on {side} rank {rank}")
            entry.ranks.append(rank)
            entry.pieces.append(index)
            entry.boxes.append(meta.box)
    return out


def _match(name: str, src: _Tensor, dst: _Tensor, item: int, balance_split_bytes: int) -> _Match:
    """The reference planner's matching for one tensor, with pieces numbered by list position."""
    dst_pieces = [_Holder(r, k, b) for k, (r, b) in enumerate(zip(dst.ranks, dst.boxes)) if b.numel]
    if len(dst_pieces) != len({h.rank for h in dst_pieces}):
        _check_destinations(name, dst_pieces)
    regions, index = _source_regions(name, [_Holder(r, k, b) for k, (r, b) in enumerate(zip(src.ranks, src.boxes))])
    dst_pos: list[int] = []
    region_of: list[int] = []
    src_boxes: list[Box] = []
    dst_boxes: list[Box] = []
    nbytes: list[int] = []
    for d in dst_pieces:
        covered = 0
        for i, common in index.overlapping(d.box):
            region = regions[i]
            covered += common.numel
            big = common.numel * item >= balance_split_bytes
            slabs = _split_rows(common, len(region.holders)) if big and len(region.holders) > 1 else [common]
            for slab in slabs:
                dst_pos.append(d.piece)
                region_of.append(i)
                src_boxes.append(slab.relative_to(region.box))
                dst_boxes.append(slab.relative_to(d.box))
                nbytes.append(slab.numel * item)
        if covered != d.box.numel:
            raise PlanError(f"{name}: {d.box.numel - covered} of {d.box.numel} elements of box "
                            f"{d.box} on gen rank {d.rank} are held by no train rank")
    holders = [[h.piece for h in r.holders] for r in regions]
    fixed = np.array([holders[i][0] if len(holders[i]) == 1 else -1 for i in region_of], dtype=np.int64)
    return _Match(dst_pos, region_of, src_boxes, dst_boxes, np.array(nbytes, dtype=np.int64), holders, fixed)


def _new_transfer(name: str, src: int, src_piece: int, src_box: Box, dst: int, dst_piece: int, dst_box: Box,
                  dtype: torch.dtype) -> Transfer:
    """A :class:`Transfer` from known-good fields, without the frozen dataclass' per-field setattr."""
    t = object.__new__(Transfer)
    t.__dict__.update(name=name, src=src, src_piece=src_piece, src_box=src_box, dst=dst, dst_piece=dst_piece,
                      dst_box=dst_box, dtype=dtype)
    return t


def plan_transfers_fast(src_ranks: Sequence[Sequence[PieceMeta]], dst_ranks: Sequence[Sequence[PieceMeta]], *,
                        cast: CastPolicy | str = CastPolicy.CAST, allow_unused_sources: bool = False,
                        balance_split_bytes: int = 1 << 20,
                        distance: Callable[[int, int], int] | None = None) -> list[Transfer]:
    """:func:`refit_core.planner.plan_transfers`' result (same arguments, same transfers), in seconds at scale."""
    src_by_name = _side("train", src_ranks)
    dst_by_name = _side("gen", dst_ranks)
    check_specs({n: t.spec for n, t in src_by_name.items()}, {n: t.spec for n, t in dst_by_name.items()},
                cast=cast, allow_unused_sources=allow_unused_sources)

    matches: dict[tuple, _Match] = {}
    order: list[tuple[str, _Match]] = []
    for name, dst in dst_by_name.items():
        src = src_by_name[name]
        item = dtype_size(dst.spec.dtype)
        signature = (src.spec.shape, item, src.key(), dst.key())
        match = matches.get(signature)
        if match is None:
            match = matches[signature] = _match(name, src, dst, item, balance_split_bytes)
        order.append((name, match))

    chosen = _choose_holders(order, src_by_name, dst_by_name, len(src_ranks), distance)
    transfers: list[Transfer] = []
    start = 0
    for name, match in order:
        src, dst = src_by_name[name], dst_by_name[name]
        dtype = dst.spec.dtype
        picks = chosen[start:start + len(match.dst_pos)].tolist()
        start += len(match.dst_pos)
        for k, pos in enumerate(match.dst_pos):
            h = picks[k]
            transfers.append(_new_transfer(name, src.ranks[h], src.pieces[h], match.src_boxes[k], dst.ranks[pos],
                                           dst.pieces[pos], match.dst_boxes[k], dtype))
    return transfers


def _choose_holders(order: Sequence[tuple[str, _Match]], src_by_name: dict[str, _Tensor],
                    dst_by_name: dict[str, _Tensor], num_src: int,
                    distance: Callable[[int, int], int] | None) -> np.ndarray:
    """The source position serving every row, in the order of ``order``: the reference planner's greedy
    (largest first, ties in row order; the least-loaded, then lowest, train rank among the nearest replicas)."""
    if not order:
        return np.zeros(0, dtype=np.int64)
    sizes = np.concatenate([m.nbytes for _, m in order])
    chosen = np.concatenate([m.fixed for _, m in order])
    multi = np.flatnonzero(chosen < 0)
    if not len(multi):
        return chosen
    # source rank of every single-holder row, for the loads that accumulate before each multi-holder row
    fixed_rank = np.concatenate([np.asarray(src_by_name[n].ranks, dtype=np.int64)[np.maximum(m.fixed, 0)]
                                 for n, m in order])
    rows = np.argsort(-sizes, kind="stable")
    is_multi = chosen[rows] < 0
    load = np.zeros(num_src, dtype=np.int64)
    row_owner = np.repeat(np.arange(len(order)), [len(m.dst_pos) for _, m in order])
    row_start = np.concatenate([[0], np.cumsum([len(m.dst_pos) for _, m in order])])
    done = 0
    for at in np.flatnonzero(is_multi).tolist():
        if at > done:
            singles = rows[done:at]
            np.add.at(load, fixed_rank[singles], sizes[singles])
        row = int(rows[at])
        name, match = order[int(row_owner[row])]
        k = row - int(row_start[row_owner[row]])
        src = src_by_name[name]
        candidates = match.holders[match.region[k]]
        if distance is not None:
            receiver = dst_by_name[name].ranks[match.dst_pos[k]]
            near = [distance(src.ranks[h], receiver) for h in candidates]
            candidates = [h for h, d in zip(candidates, near) if d == min(near)]
        pick = min(candidates, key=lambda h: (int(load[src.ranks[h]]), src.ranks[h]))
        chosen[row] = pick
        load[src.ranks[pick]] += sizes[row]
        done = at + 1
    return chosen


__all__ = ["plan_transfers_fast"]
