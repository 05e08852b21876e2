"""The planner's fast path: the reference planner's transfers, exploiting the layouts' regularity.

Layouts are regular: the same tensor of every layer is cut the same way on both sides (the same
ranks hold the same boxes), only its name and its pieces' local indices differ. This planner groups
logical tensors by that *signature* (shape, dtype and every ``(rank, box)`` of both sides, in order),
matches one representative per group with the steps it shares with the reference planner
(:mod:`refit_core.plan.regions`), and stamps the result across the group, renaming pieces; the boxes of
the stamped transfers are shared objects. Replica choice (largest region first, to the least-loaded
replica) runs over all regions at once in numpy where a region has one holder; only regions held by
several replicas take a Python step each.

The result equals :func:`refit_core.plan.reference.plan_transfers`' transfer for transfer (same order, same
sources), so schedules and fingerprints are the same (``tests/scale/test_plan_fast.py``); errors are
the reference planner's, raised for the same first tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from refit_core.contract.errors import PlanError
from refit_core.contract.options import CastPolicy
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.side import Side
from refit_core.contract.spec import Box, TensorSpec, dtype_size
from refit_core.plan.items import Transfer, new_transfer
from refit_core.plan.reference import check_specs, plan_transfers
from refit_core.plan.regions import Holder, check_destinations, covering_slabs, readers_per_region, source_regions


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
    """A representative tensor's matched regions: row ``i`` moves ``src_boxes[i]`` of source region
    ``region[i]`` into ``dst_boxes[i]`` of the piece at position ``dst_pos[i]`` of its destination list
    (boxes relative to the pieces; source pieces are named by position in the source list too)."""

    dst_pos: list[int]
    region: list[int]
    src_boxes: list[Box]
    dst_boxes: list[Box]
    nbytes: np.ndarray
    dst_ranks: list[int]
    """Per row: the gen rank receiving it."""
    fixed: np.ndarray
    """Per row: the only holder's position, or -1 when the region has replicas."""
    multi: np.ndarray
    """The rows whose region has replicas."""
    options: np.ndarray
    """``[len(multi), replicas, 2]``: each such row's holders as (position, train rank), padded with -1."""


def _side(side: Side, ranks: Sequence[Sequence[PieceMeta]]) -> dict[str, _Tensor]:
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
    dst_pieces = [Holder(r, k, b) for k, (r, b) in enumerate(zip(dst.ranks, dst.boxes)) if b.numel]
    if len(dst_pieces) != len({h.rank for h in dst_pieces}):
        check_destinations(name, dst_pieces)
    regions, index = source_regions(name, [Holder(r, k, b) for k, (r, b) in enumerate(zip(src.ranks, src.boxes))])
    dst_pos: list[int] = []
    region_of: list[int] = []
    src_boxes: list[Box] = []
    dst_boxes: list[Box] = []
    nbytes: list[int] = []
    overlaps = [list(index.overlapping(d.box)) for d in dst_pieces]
    readers = readers_per_region(len(regions), overlaps)
    for d, found in zip(dst_pieces, overlaps):
        for i, slab in covering_slabs(name, d, found, regions, readers, item, balance_split_bytes):
            dst_pos.append(d.piece)
            region_of.append(i)
            src_boxes.append(slab.relative_to(regions[i].box))
            dst_boxes.append(slab.relative_to(d.box))
            nbytes.append(slab.numel * item)
    holders = [[h.piece for h in r.holders] for r in regions]
    fixed = np.array([holders[i][0] if len(holders[i]) == 1 else -1 for i in region_of], dtype=np.int64)
    multi = np.flatnonzero(fixed < 0)
    width = max((len(h) for h in holders), default=1)
    table = np.full((len(regions), width, 2), -1, dtype=np.int64)
    for i, region in enumerate(regions):
        table[i, :len(region.holders)] = [(h.piece, h.rank) for h in region.holders]
    options = table[np.asarray(region_of, dtype=np.int64)[multi]] if len(multi) else table[:0]
    return _Match(dst_pos, region_of, src_boxes, dst_boxes, np.array(nbytes, dtype=np.int64),
                  [dst.ranks[p] for p in dst_pos], fixed, multi, options)


def plan_transfers_fast(src_ranks: Sequence[Sequence[PieceMeta]], dst_ranks: Sequence[Sequence[PieceMeta]], *,
                        cast: CastPolicy | str = CastPolicy.CAST, allow_unused_sources: bool = False,
                        balance_split_bytes: int = 1 << 20,
                        distance: Callable[[int, int], int] | None = None) -> list[Transfer]:
    """:func:`refit_core.plan.reference.plan_transfers`' result (same arguments, same transfers), in seconds at scale.

    Plans with quantized destinations (FP8, :class:`~refit_core.contract.spec.Quantization`) are made by the reference
    planner itself: their block-aligned slabs and quantization sites have no fast path yet.
    """
    if any(meta.spec.quant is not None for metas in dst_ranks for meta in metas):
        return plan_transfers(src_ranks, dst_ranks, cast=cast, allow_unused_sources=allow_unused_sources,
                              balance_split_bytes=balance_split_bytes, distance=distance)
    src_by_name = _side(Side.TRAIN, src_ranks)
    dst_by_name = _side(Side.GEN, dst_ranks)
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

    chosen = _choose_holders(order, src_by_name, len(src_ranks), distance)
    transfers: list[Transfer] = []
    append = transfers.append
    start = 0
    for name, match in order:
        src, dst = src_by_name[name], dst_by_name[name]
        src_ranks_of, src_pieces_of, dst_pieces_of, dtype = src.ranks, src.pieces, dst.pieces, dst.spec.dtype
        stop = start + len(match.dst_pos)
        for h, src_box, dst_rank, p, dst_box in zip(chosen[start:stop].tolist(), match.src_boxes, match.dst_ranks,
                                                     match.dst_pos, match.dst_boxes):
            append(new_transfer(name, src_ranks_of[h], src_pieces_of[h], src_box, dst_rank, dst_pieces_of[p], dst_box,
                                dtype, None))  # known-good fields: no per-field setattr
        start = stop
    return transfers


def _choose_holders(order: Sequence[tuple[str, _Match]], src_by_name: dict[str, _Tensor], num_src: int,
                    distance: Callable[[int, int], int] | None) -> np.ndarray:
    """The source position serving every row, in the order of ``order``: the reference planner's greedy
    walk (largest row first, ties in row order; each row to the least-loaded, then lowest, train rank
    among its nearest replicas).

    Rows with one holder only add load, so the walk is replayed for the rows with replicas alone:
    the load single-holder rows put on each candidate before it comes from per-rank prefix sums.
    """
    if not order:
        return np.zeros(0, dtype=np.int64)
    sizes = np.concatenate([m.nbytes for _, m in order])
    chosen = np.concatenate([m.fixed for _, m in order])
    if not (chosen < 0).any():
        return chosen
    counts = [len(m.dst_pos) for _, m in order]
    first = np.concatenate([[0], np.cumsum(counts)])[:-1]
    walk = np.empty(len(sizes), dtype=np.int64)
    walk[np.argsort(-sizes, kind="stable")] = np.arange(len(sizes))  # each row's step in the walk
    rank_of = np.concatenate([np.asarray(src_by_name[n].ranks, dtype=np.int64)[np.maximum(m.fixed, 0)]
                              for n, m in order])

    # single-holder rows: per rank, cumulative bytes in walk order
    single = np.flatnonzero(chosen >= 0)
    key = rank_of[single] * len(sizes) + walk[single]
    by_key = np.argsort(key)
    key = key[by_key]
    cum = np.concatenate([[0], np.cumsum(sizes[single][by_key])])
    rank_start = np.searchsorted(key, np.arange(num_src) * len(sizes))

    # rows with replicas, in walk order, and their candidates (position, rank), padded with -1
    width = max(m.options.shape[1] for _, m in order)
    rows = np.concatenate([first[i] + m.multi for i, (_, m) in enumerate(order)])
    options = np.concatenate([np.pad(m.options, ((0, 0), (0, width - m.options.shape[1]), (0, 0)),
                                     constant_values=-1) for _, m in order])
    receivers = np.concatenate([np.asarray(m.dst_ranks, dtype=np.int64)[m.multi] for _, m in order])
    step = np.argsort(walk[rows])
    rows, options, receivers = rows[step], options[step], receivers[step]
    pos, rank = options[..., 0], options[..., 1]
    valid = rank >= 0
    if distance is not None:
        far = _distances(distance, rank, receivers, valid)
        valid &= far == np.where(valid, far, np.iinfo(np.int64).max).min(axis=1, keepdims=True)
    safe = np.where(valid, rank, 0)
    before = cum[np.searchsorted(key, safe * len(sizes) + walk[rows][:, None])] - cum[rank_start[safe]]

    # the walk itself, row by row in plain Python: consecutive replicated rows mostly share their
    # candidates (the DP replicas of one stage), so numpy steps over independent rows would be one row long.
    # Per candidate, ``(load before) * num_src + rank`` (invalid ones never win) and the walk's own load
    # (scaled the same) sum to the reference planner's key (load, rank); the first minimum is the pick.
    base = np.where(valid, before * num_src + safe, np.int64(1) << 62)
    scaled = sizes[rows] * num_src
    loads = [0] * num_src
    slots = []
    for nbytes, ranks, bases in zip(scaled.tolist(), safe.tolist(), base.tolist()):
        scores = [b + loads[r] for r, b in zip(ranks, bases)]
        slot = scores.index(min(scores))
        slots.append(slot)
        loads[ranks[slot]] += nbytes
    picks = pos[np.arange(len(rows)), np.asarray(slots, dtype=np.int64)]
    chosen[rows] = picks
    return chosen


def _distances(distance: Callable[[int, int], int], rank: np.ndarray, receivers: np.ndarray,
               valid: np.ndarray) -> np.ndarray:
    """``distance(rank, receiver)`` for every candidate, calling it once per distinct pair."""
    pairs = np.stack([np.where(valid, rank, 0), np.broadcast_to(receivers[:, None], rank.shape)], axis=-1)
    unique, inverse = np.unique(pairs.reshape(-1, 2), axis=0, return_inverse=True)
    values = np.array([distance(int(a), int(b)) for a, b in unique], dtype=np.int64)
    return values[inverse.reshape(-1)].reshape(rank.shape)


__all__ = ["plan_transfers_fast"]
