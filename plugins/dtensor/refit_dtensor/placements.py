"""DTensor placements -> the boxes of the global tensor a rank holds, without gathering anything.

A rank's local tensor of a DTensor is, along every tensor dimension independently, a sequence of
global indices: the result of applying each mesh dimension's sharding in order (left to right, or
in the spec's explicit ``shard_order``) to ``arange(size)``, with torch's own splitting code, so
uneven ``Shard`` (``torch.chunk`` semantics, possibly empty shards) and ``_StridedShard`` (FSDP2 on
top of TP: right-to-left sharding, several row ranges per rank) come out exactly as torch lays
them out. Maximal runs of consecutive global indices become boxes; a rank's boxes are the
Cartesian product of its runs over all dimensions. Only tiny index vectors are ever built.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Shard, _StridedShard

from refit_core import Box, PluginError


@dataclass(frozen=True)
class LocalBlock:
    """``box`` of the global tensor sits at ``local`` (same sizes) of the rank's local tensor."""

    box: Box
    local: Box


def _split_factor(placement: _StridedShard) -> int:
    getter = getattr(placement, "_split_factor_int", None)  # torch >= 2.13; older: an int attribute
    return int(getter()) if getter is not None else int(placement.split_factor)


def _as_dim0(placement: Placement) -> Placement:
    """The same sharding applied to dimension 0 of a 1-D index vector."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=_split_factor(placement))
    return Shard(0)


def _is_shard_like(placement: Placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard))


def dim_indices(size: int, shardings: Sequence[tuple[Placement, int, int]]) -> torch.Tensor:
    """Global indices (in local order) of one tensor dimension after ``shardings``.

    Each sharding is ``(placement, mesh_dim_size, coordinate)``; they apply in the given order.
    """
    index = torch.arange(size)
    for placement, chunks, coordinate in shardings:
        pieces, _ = _as_dim0(placement)._split_tensor(index, chunks, with_padding=False, contiguous=False)
        index = pieces[coordinate]
    return index


def runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values: ``(global_start, local_start, length)``."""
    n = index.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, n]
    return [(int(index[s]), s, e - s) for s, e in zip(starts, ends)]


def _key(placement: Placement) -> tuple[int, int]:
    """A hashable stand-in: ``(0, 0)`` for Shard, ``(1, split_factor)`` for _StridedShard."""
    if isinstance(placement, _StridedShard):
        return (1, _split_factor(placement))
    return (0, 0)


@functools.lru_cache(maxsize=4096)
def _dim_runs(size: int, shardings: tuple[tuple[tuple[int, int], int, int], ...]) -> tuple[tuple[int, int, int], ...]:
    every = _every_coordinate_runs(size, tuple((k, n) for k, n, _ in shardings))
    return every[tuple(c for _, _, c in shardings)]


@functools.lru_cache(maxsize=256)
def _every_coordinate_runs(size: int, shardings: tuple[tuple[tuple[int, int], int], ...]
                           ) -> dict[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
    """The runs of one tensor dimension at every mesh coordinate at once: one split yields every
    coordinate's chunk, so describing all ranks of a layout costs about as much as describing one."""
    level: dict[tuple[int, ...], torch.Tensor] = {(): torch.arange(size)}
    for key, chunks in shardings:
        placement = _StridedShard(0, split_factor=key[1]) if key[0] else Shard(0)
        split: dict[tuple[int, ...], torch.Tensor] = {}
        for coordinate, index in level.items():
            pieces, _ = placement._split_tensor(index, chunks, with_padding=False, contiguous=False)
            for c in range(chunks):
                split[(*coordinate, c)] = pieces[c]
        level = split
    return {coordinate: tuple(runs(index)) for coordinate, index in level.items()}


def shard_order(placements: Sequence[Placement], ndim: int,
                explicit: Sequence | None = None) -> list[list[int]]:
    """For every tensor dimension, the mesh dimensions that shard it, in application order.

    ``explicit`` is a DTensorSpec ``shard_order`` (entries with ``tensor_dim`` and ``mesh_dims``);
    without it the order is left to right, which ``_StridedShard`` placements are defined for.
    """
    order: list[list[int]] = [[] for _ in range(ndim)]
    if explicit:
        for entry in explicit:
            order[entry.tensor_dim] = list(entry.mesh_dims)
        return order
    for mesh_dim, placement in enumerate(placements):
        if _is_shard_like(placement):
            order[placement.dim].append(mesh_dim)
    return order


def local_blocks(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Placement], explicit_order: Sequence | None = None,
                 what: str = "tensor") -> list[LocalBlock]:
    """The blocks of a tensor of global ``shape`` held at ``coordinate`` of a mesh of ``mesh_shape``.

    Empty when the rank holds nothing (an empty uneven shard).
    """
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise PluginError(f"{what}: {len(placements)} placements for a mesh of shape {tuple(mesh_shape)}")
    for placement in placements:
        if isinstance(placement, Partial):
            raise PluginError(f"{what} has a Partial placement ({placements}): partial sums are not "
                              "weights; reduce them before refit")
    ndim = len(shape)
    normalized = [Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements]
    order = shard_order(normalized, ndim, explicit_order)
    per_dim = []
    for dim in range(ndim):
        shardings = tuple((_key(normalized[m]), mesh_shape[m], coordinate[m]) for m in order[dim])
        per_dim.append(_dim_runs(shape[dim], shardings))
        if not per_dim[-1] and shape[dim] > 0:
            return []
    if any(s == 0 for s in shape):
        return []
    blocks = []
    for combo in itertools.product(*per_dim):
        box = Box(tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo))
        local = Box(tuple(start for _, start, _ in combo), tuple(n for _, _, n in combo))
        blocks.append(LocalBlock(box, local))
    return blocks


def _order_of(spec: object) -> tuple[tuple[Placement, ...], Sequence | None]:
    """A DTensorSpec's placements and its explicit shard order, if it has one.

    ``_StridedShard`` placements normally encode the order themselves (applied left to right);
    a spec that carries an explicit ``shard_order`` instead (torch >= 2.10) applies plain shards
    in that order, with any ``_StridedShard`` read as a plain ``Shard``.
    """
    placements = tuple(spec.placements)
    strided = any(isinstance(p, _StridedShard) for p in placements)
    uses_strided = getattr(spec, "use_strided_shard_as_shard_order", None)
    if uses_strided is None:
        uses_strided = strided
    order = getattr(spec, "shard_order", None)
    if uses_strided or not order:
        return placements, None
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements), order


def tensor_blocks(tensor: torch.Tensor, what: str = "tensor") -> tuple[torch.Tensor, list[LocalBlock]]:
    """``(local tensor, blocks)`` of a live tensor: a DTensor's shards, or a plain tensor whole.

    The local tensor is the DTensor's own local storage (``_local_tensor``), so views of it are
    written and read in place.
    """
    if isinstance(tensor, DTensor):
        spec = tensor._spec
        mesh = spec.mesh
        coordinate = mesh.get_coordinate()
        local = tensor._local_tensor
        if coordinate is None:  # this rank is not part of the tensor's mesh
            return local, []
        placements, explicit = _order_of(spec)
        blocks = local_blocks(tuple(tensor.shape), tuple(mesh.shape), coordinate, placements, explicit, what)
        expected = tuple(max((b.local.ends[d] for b in blocks), default=0) for d in range(tensor.ndim))
        if blocks and expected != tuple(local.shape):
            raise PluginError(f"{what}: placements {spec.placements} on mesh {tuple(mesh.shape)} imply a "
                              f"local shape {expected}, but the local tensor is {tuple(local.shape)}")
        return local, blocks
    if tensor.is_meta:
        raise PluginError(f"{what} is on the meta device: materialize the model before refit")
    full = Box.full(tuple(tensor.shape))
    return tensor, ([] if full.is_empty() else [LocalBlock(full, full)])
