"""Boxes, pieces and expert grouping."""

import pytest
import torch

from refit_core.contract.experts import (
    ExpertName,
    default_expert_name,
    expert_counts,
    group_meta,
    group_piece,
    ungroup_name,
)
from refit_core.contract.layout import ParallelLayout, parse_backend_layout
from refit_core.contract.pieces import PieceMeta, SourcePiece
from refit_core.contract.spec import Box, TensorSpec, dtype_from_name


def test_box_intersection_relative_coordinates_and_views():
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 4))
    common = a.intersect(b)
    assert common == Box((2, 2), (2, 2))
    assert common.relative_to(a) == Box((2, 0), (2, 2))
    assert Box((0, 0), (2, 2)).intersect(Box((2, 0), (2, 2))) is None
    t = torch.arange(36.).view(6, 6)
    assert torch.equal(common.slice_of(t), t[2:4, 2:4])


def test_piece_rejects_views_that_do_not_match_their_box_or_dtype():
    spec = TensorSpec("w", (4, 4), torch.float32)
    with pytest.raises(ValueError, match=r"w: view shape \(2, 4\) != box sizes \(2, 2\)"):
        SourcePiece(spec, Box((0, 0), (2, 2)), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"w: view dtype torch.bfloat16 != spec dtype torch.float32"):
        SourcePiece(spec, Box((0, 0), (2, 2)), torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"w: box \[3:5, 0:1\] lies outside shape \(4, 4\)"):
        SourcePiece(spec, Box((3, 0), (2, 1)))


def test_per_expert_names_group_into_one_stacked_tensor():
    assert default_expert_name("model.layers.1.mlp.experts.12.down_proj.weight") == \
        ExpertName("model.layers.1.mlp.experts.down_proj.weight", 12)
    assert default_expert_name("model.layers.1.mlp.gate.weight") is None
    assert (ungroup_name("model.layers.1.mlp.experts.down_proj.weight", 3)
            == "model.layers.1.mlp.experts.3.down_proj.weight")
    metas = [[PieceMeta(TensorSpec(f"l.experts.{e}.w1.weight", (4, 8), torch.float32), Box((0, 2), (4, 6)))
              for e in (0, 1)],
             [PieceMeta(TensorSpec("l.experts.2.w1.weight", (4, 8), torch.float32), Box((0, 0), (4, 8)))]]
    counts = expert_counts(metas, default_expert_name)
    assert counts == {"l.experts.w1.weight": 3}
    grouped = group_meta(metas[0][1], default_expert_name, counts)
    assert grouped == PieceMeta(TensorSpec("l.experts.w1.weight", (3, 4, 8), torch.float32), Box((1, 0, 2), (1, 4, 6)))
    piece = SourcePiece(metas[0][1].spec, metas[0][1].box, torch.zeros(4, 6))
    assert group_piece(piece, default_expert_name, counts).view.shape == (1, 4, 6)


def test_layouts_parse_from_the_command_line_form():
    assert parse_backend_layout("dtensor:fsdp=2,tp=2") == ("dtensor", ParallelLayout(fsdp=2, tp=2))
    assert ParallelLayout.parse("tp=2,dp=2,ep=4").world_size == 4
    assert str(ParallelLayout.parse("")) == "single"
    assert dtype_from_name("bf16") is torch.bfloat16
