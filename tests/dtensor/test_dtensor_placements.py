"""DTensor placements -> boxes: torch's own chunk semantics, strided shards, errors."""

import pytest
from dtensor_ranks import placement_ranks
from refit_dtensor.placements import local_blocks
from torch.distributed.tensor import Partial, Replicate, Shard, _StridedShard

from refit_core import Box, PluginError
from refit_core.kit.launch import free_port, spawn


def boxes(shape, mesh, coordinate, placements, order=None):
    return [(b.box, b.local) for b in local_blocks(shape, mesh, coordinate, placements, order)]


def test_uneven_shard_follows_torch_chunk_including_empty_last_shards():
    sizes = [[b.sizes[0] for b, _ in boxes((5, 3), (4,), (r,), [Shard(0)])] for r in range(4)]
    assert sizes == [[2], [2], [1], []]
    assert boxes((5, 3), (4,), (2,), [Shard(0)]) == [(Box((4, 0), (1, 3)), Box((0, 0), (1, 3)))]


def test_strided_shard_gives_several_boxes_per_rank():
    got = boxes((12, 2), (4,), (1,), [_StridedShard(0, split_factor=2)])
    assert got == [(Box((2, 0), (2, 2)), Box((0, 0), (2, 2))), (Box((8, 0), (2, 2)), Box((2, 0), (2, 2)))]


def test_fsdp_over_tp_strided_shard_is_tp_major():
    # FSDP2 (dim 0 of the mesh) over TP (dim 1) of a column-parallel weight: rank (dp=1, tp=0)
    # holds the second quarter of TP rank 0's half, i.e. rows 2..3 of 8.
    got = boxes((8, 4), (2, 2), (1, 0), [_StridedShard(0, split_factor=2), Shard(0)])
    assert got == [(Box((2, 0), (2, 4)), Box((0, 0), (2, 4)))]


def test_explicit_shard_order_applies_mesh_dims_in_that_order():
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    got = boxes((8, 4), (2, 2), (1, 0), [Shard(0), Shard(0)], order)
    assert got == [(Box((2, 0), (2, 4)), Box((0, 0), (2, 4)))]


def test_replicate_and_two_dims():
    got = boxes((5, 7), (2, 2), (1, 1), [Shard(1), Shard(0)])
    assert got == [(Box((3, 4), (2, 3)), Box((0, 0), (2, 3)))]
    assert boxes((4,), (2,), (1,), [Replicate()]) == [(Box((0,), (4,)), Box((0,), (4,)))]


def test_partial_placement_is_refused_with_the_tensor_name():
    with pytest.raises(PluginError, match="w.*Partial"):
        local_blocks((4,), (2,), (0,), [Partial()], what="w")


def test_boxes_of_live_dtensors_assemble_to_full_tensor_on_4_ranks():
    """Uneven and empty shards, FSDP2 on a 3-row weight over 4 ranks, _StridedShard (also built
    by redistribute), mixed dims: every rank's blocks, gathered, equal full_tensor()."""
    results = spawn(placement_ranks, 4, free_port(), timeout_s=120)
    problems = {case: found for rank in results for case, found in rank.items() if found}
    assert not problems, problems
    assert len(results[0]) == 9
