"""The planner: match every destination byte with exactly one source, once, at setup.

Input is metadata only: each rank's piece list (already expert-grouped). Output is a list of
:class:`Transfer` (a region of one logical tensor, from one train rank to one gen rank), which
:mod:`refit_core.plan.schedule` cuts into messages and rounds. Every disagreement between the sides is
a :class:`~refit_core.contract.errors.PlanError` naming the tensors, raised before any collective.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from refit_core.contract.errors import PlanError
from refit_core.contract.options import CastPolicy
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.side import Side
from refit_core.contract.spec import Box, TensorSpec, dtype_size
from refit_core.plan.items import Transfer
from refit_core.plan.quant_rules import assign_sites, computed_scales, quantization_rules
from refit_core.plan.regions import (
    Holder,
    SourceRegion,
    check_destinations,
    covering_slabs,
    readers_per_region,
    source_regions,
)

_MAX_LISTED = 5


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _specs_by_name(side: Side, ranks: Sequence[Sequence[PieceMeta]]) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    for rank, metas in enumerate(ranks):
        for meta in metas:
            known = specs.setdefault(meta.spec.name, meta.spec)
            if known is not meta.spec and known != meta.spec:
                raise PlanError(f"{side} ranks disagree on {meta.spec.name}: {known.shape} {known.dtype} "
                                f"vs {meta.spec.shape} {meta.spec.dtype} on {side} rank {rank}")
    return specs


def check_specs(src: dict[str, TensorSpec], dst: dict[str, TensorSpec], *, cast: CastPolicy | str,
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
    if cast == CastPolicy.STRICT:  # a quantized destination asks for its conversion itself
        dtypes = [f"{n}: source {src[n].dtype} vs destination {d.dtype}" for n, d in dst.items()
                  if src[n].dtype != d.dtype and d.quant is None]
        if dtypes:
            raise PlanError(f"dtype mismatch in {len(dtypes)} tensor(s) under cast policy 'strict': "
                            f"{_listing(dtypes)}")
    elif cast != CastPolicy.CAST:
        raise PlanError(f"unknown cast policy {cast!r}: use 'cast' or 'strict'")


@dataclass(frozen=True)
class _Pending:
    """A region of a destination piece to be served by one of its source region's holders."""

    name: str
    dst: Holder
    region: Box
    source: SourceRegion
    nbytes: int


def plan_transfers(src_ranks: Sequence[Sequence[PieceMeta]], dst_ranks: Sequence[Sequence[PieceMeta]], *,
                   cast: CastPolicy | str = CastPolicy.CAST, allow_unused_sources: bool = False,
                   balance_split_bytes: int = 1 << 20,
                   distance: Callable[[int, int], int] | None = None) -> list[Transfer]:
    """Match destinations to sources and balance replicas; deterministic for the same input.

    Each destination region is served by one replica; regions of at least ``balance_split_bytes``
    held by R replicas and read by K destination pieces are cut into ``ceil(R / K)`` slabs per piece
    first (:func:`~refit_core.plan.regions.slab_count`: one slab per replica for a single reader, none
    where readers outnumber replicas, so the work grows with R + K, not R x K), then every region goes
    to the least-loaded replica, largest regions first, so the busiest sender sends as little as possible.
    ``distance(train_rank, gen_rank)`` (e.g. :meth:`refit_core.plan.simulate.GpuPlacement.distance`), when
    given, ranks replicas first: the nearest replicas to the receiver (same GPU, then same node) are
    the only candidates, and load balances among them, spreading a node's traffic over its GPUs' links.
    """
    src_specs = _specs_by_name(Side.TRAIN, src_ranks)
    dst_specs = _specs_by_name(Side.GEN, dst_ranks)
    rules = quantization_rules(src_specs, dst_specs)
    computed = computed_scales(rules)  # scale tensors refit computes: no source, no transfers
    check_specs(src_specs, {n: s for n, s in dst_specs.items() if n not in computed}, cast=cast,
                allow_unused_sources=allow_unused_sources)

    src_by_name = _holders_by_name(src_ranks)
    dst_by_name = _holders_by_name(dst_ranks)

    pending: list[_Pending] = []
    for name, dst_pieces in dst_by_name.items():
        dst_pieces = [p for p in dst_pieces if p.box.numel]
        check_destinations(name, dst_pieces)
        if name in computed:
            continue
        regions, index = source_regions(name, src_by_name[name])
        item = dtype_size(dst_specs[name].dtype)
        rows = rules[name].quant.block[0] if name in rules and rules[name].quantize else 1
        overlaps = [list(index.overlapping(dst.box)) for dst in dst_pieces]
        readers = readers_per_region(len(regions), overlaps)
        for dst, found in zip(dst_pieces, overlaps):
            pending.extend(_Pending(name, dst, slab, regions[i], slab.numel * item) for i, slab in
                           covering_slabs(name, dst, found, regions, readers, item, balance_split_bytes, rows))

    load = [0] * len(src_ranks)
    chosen: list[Holder] = [None] * len(pending)  # type: ignore[list-item]
    sizes = [p.nbytes for p in pending]
    # largest first, ties in pending order (a stable sort keeps it under reverse=True)
    for i in sorted(range(len(pending)), key=sizes.__getitem__, reverse=True):
        holders = pending[i].source.holders
        if len(holders) > 1 and distance is not None:
            receiver = pending[i].dst.rank
            nearest = min(distance(h.rank, receiver) for h in holders)
            holders = [h for h in holders if distance(h.rank, receiver) == nearest]
        holder = holders[0] if len(holders) == 1 else min(holders, key=lambda h: (load[h.rank], h.rank))
        load[holder.rank] += sizes[i]
        chosen[i] = holder

    transfers = []
    for i, p in enumerate(pending):
        src = chosen[i]
        transfers.append(Transfer(p.name, src.rank, src.piece, p.region.relative_to(p.source.box),
                                  p.dst.rank, p.dst.piece, p.region.relative_to(p.dst.box), dst_specs[p.name].dtype))
    return assign_sites(transfers, rules, dst_ranks, dst_specs) if rules else transfers


def _holders_by_name(ranks: Sequence[Sequence[PieceMeta]]) -> dict[str, list[Holder]]:
    by_name: dict[str, list[Holder]] = defaultdict(list)
    for rank, metas in enumerate(ranks):
        for index, meta in enumerate(metas):
            by_name[meta.spec.name].append(Holder(rank, index, meta.box))
    return by_name
