"""The planner: match every destination byte with exactly one source, once, at setup.

Input is metadata only: each rank's piece list (already expert-grouped). Output is a list of
:class:`Transfer` (a region of one logical tensor, from one train rank to one gen rank), which
:mod:`refit_core.schedule` cuts into messages and rounds. Every disagreement between the sides is
a :class:`~refit_core.errors.PlanError` naming the tensors, raised before any collective.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import PlanError
from .boxindex import BoxIndex
from .pieces import PieceMeta
from .spec import Box, TensorSpec, dtype_size

CAST = "cast"
STRICT = "strict"
_MAX_LISTED = 5


@dataclass(frozen=True)
class Transfer:
    """One region moving from a train rank to a gen rank.

    Boxes are relative to the source and destination pieces; both have the same sizes.
    ``dtype`` is the wire dtype (the destination's: the sender casts).
    """

    name: str
    src: int
    src_piece: int
    src_box: Box
    dst: int
    dst_piece: int
    dst_box: Box
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.src_box.numel * dtype_size(self.dtype)


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _specs_by_name(side: str, ranks: Sequence[Sequence[PieceMeta]]) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    for rank, metas in enumerate(ranks):
        for meta in metas:
            known = specs.setdefault(meta.spec.name, meta.spec)
            if known != meta.spec:
                raise PlanError(f"{side} ranks disagree on {meta.spec.name}: {known.shape} {known.dtype} "
                                f"vs {meta.spec.shape} {meta.spec.dtype} on {side} rank {rank}")
    return specs


def check_specs(src: dict[str, TensorSpec], dst: dict[str, TensorSpec], *, cast: str,
                allow_unused_sources: bool) -> None:
    """Names on one side only, shape and dtype disagreements: all found before anything moves."""
    missing = [n for n in dst if n not in src]
    if missing:
        raise PlanError(f"{len(missing)} destination tensor(s) have no source: {_listing(missing)}")
    unused = [n for n in src if n not in dst]
    if unused and not allow_unused_sources:
        raise PlanError(f"{len(unused)} source tensor(s) have no destination: {_listing(unused)} "
                        "(pass allow_unused_sources=True to skip them)")
    shapes = [f"{n}: source {src[n].shape} vs destination {d.shape}" for n, d in dst.items()
              if src[n].shape != d.shape]
    if shapes:
        raise PlanError(f"shape mismatch in {len(shapes)} tensor(s): {_listing(shapes)}")
    if cast == STRICT:
        dtypes = [f"{n}: source {src[n].dtype} vs destination {d.dtype}" for n, d in dst.items()
                  if src[n].dtype != d.dtype]
        if dtypes:
            raise PlanError(f"dtype mismatch in {len(dtypes)} tensor(s) under cast policy 'strict': "
                            f"{_listing(dtypes)}")
    elif cast != CAST:
        raise PlanError(f"unknown cast policy {cast!r}: use 'cast' or 'strict'")


@dataclass
class _SourceRegion:
    box: Box
    holders: list[tuple[int, int]]  # (train rank, piece index), identical replicas


def _source_regions(name: str, holders: list[tuple[int, int, Box]]) -> tuple[list[_SourceRegion], BoxIndex]:
    by_box: dict[Box, _SourceRegion] = {}
    for rank, index, box in holders:
        if box.numel:
            by_box.setdefault(box, _SourceRegion(box, [])).holders.append((rank, index))
    regions = sorted(by_box.values(), key=lambda r: (r.box.offsets, r.box.sizes))
    index = BoxIndex([r.box for r in regions])
    for i, a in enumerate(regions):
        for j, _ in index.overlapping(a.box):
            if j > i:
                b = regions[j]
                raise PlanError(f"{name}: source boxes {a.box} (train ranks {[h[0] for h in a.holders]}) and "
                                f"{b.box} (train ranks {[h[0] for h in b.holders]}) overlap without being "
                                "replicas of each other")
    return regions, index


def _check_destinations(name: str, pieces: list[tuple[int, int, Box]]) -> None:
    by_rank: dict[int, list[Box]] = defaultdict(list)
    for rank, _, box in pieces:
        for other in by_rank[rank]:
            if other.intersect(box) is not None:
                raise PlanError(f"{name}: destination boxes {other} and {box} overlap on gen rank {rank}")
        by_rank[rank].append(box)


def _split_rows(box: Box, parts: int) -> list[Box]:
    """Cut a box into up to ``parts`` slabs along its first dimension."""
    rows = box.sizes[0]
    parts = max(1, min(parts, rows))
    cuts = [rows * i // parts for i in range(parts + 1)]
    return [Box((box.offsets[0] + a, *box.offsets[1:]), (b - a, *box.sizes[1:]))
            for a, b in zip(cuts, cuts[1:]) if b > a]


def plan_transfers(src_ranks: Sequence[Sequence[PieceMeta]], dst_ranks: Sequence[Sequence[PieceMeta]], *,
                   cast: str = CAST, allow_unused_sources: bool = False,
                   balance_split_bytes: int = 1 << 20) -> list[Transfer]:
    """Match destinations to sources and balance replicas; deterministic for the same input.

    Each destination region is served by one replica; regions of at least ``balance_split_bytes``
    held by several replicas are cut into one slab per replica first, then every region goes to the
    least-loaded replica, largest regions first, so the busiest sender sends as little as possible.
    """
    src_specs = _specs_by_name("train", src_ranks)
    dst_specs = _specs_by_name("gen", dst_ranks)
    check_specs(src_specs, dst_specs, cast=cast, allow_unused_sources=allow_unused_sources)

    src_by_name: dict[str, list[tuple[int, int, Box]]] = defaultdict(list)
    for rank, metas in enumerate(src_ranks):
        for index, meta in enumerate(metas):
            src_by_name[meta.spec.name].append((rank, index, meta.box))
    dst_by_name: dict[str, list[tuple[int, int, Box]]] = defaultdict(list)
    for rank, metas in enumerate(dst_ranks):
        for index, meta in enumerate(metas):
            dst_by_name[meta.spec.name].append((rank, index, meta.box))

    # (name, dst rank, dst piece, dst piece box, region, holders)
    pending: list[tuple[str, int, int, Box, Box, list[tuple[int, int]], Box]] = []
    for name, dst_pieces in dst_by_name.items():
        dst_pieces = [p for p in dst_pieces if p[2].numel]
        _check_destinations(name, dst_pieces)
        regions, index = _source_regions(name, src_by_name[name])
        item = dst_specs[name].dtype
        for dst_rank, dst_index, dst_box in dst_pieces:
            covered = 0
            for i, common in index.overlapping(dst_box):
                region = regions[i]
                covered += common.numel
                big = common.numel * dtype_size(item) >= balance_split_bytes
                slabs = _split_rows(common, len(region.holders)) if big and len(region.holders) > 1 else [common]
                for slab in slabs:
                    pending.append((name, dst_rank, dst_index, dst_box, slab, region.holders, region.box))
            if covered != dst_box.numel:
                raise PlanError(f"{name}: {dst_box.numel - covered} of {dst_box.numel} elements of box "
                                f"{dst_box} on gen rank {dst_rank} are held by no train rank")

    load: dict[int, int] = defaultdict(int)
    order = sorted(range(len(pending)), key=lambda i: (-pending[i][4].numel * dtype_size(dst_specs[pending[i][0]].dtype), i))
    chosen: dict[int, tuple[int, int]] = {}
    for i in order:
        name, *_rest = pending[i]
        holders = pending[i][5]
        nbytes = pending[i][4].numel * dtype_size(dst_specs[name].dtype)
        rank, index = min(holders, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        chosen[i] = (rank, index)

    transfers = []
    for i, (name, dst_rank, dst_index, dst_box, region, _holders, src_box) in enumerate(pending):
        src_rank, src_index = chosen[i]
        transfers.append(Transfer(name, src_rank, src_index, region.relative_to(src_box),
                                  dst_rank, dst_index, region.relative_to(dst_box), dst_specs[name].dtype))
    return transfers
