"""Records built unchecked (:func:`refit_core.contract.records.unchecked`) are the records their checked
constructors build from the same values: equal, with the same fields, the same type and the same hash."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_core.contract.pieces import DestinationPiece, PieceMeta, SourcePiece
from refit_core.contract.records import unchecked
from refit_core.contract.spec import Box, TensorSpec
from refit_core.plan.items import Segment, Transfer, new_segment, new_transfer

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])


@st.composite
def boxes(draw: st.DrawFn, ndim: int | None = None) -> Box:
    n = draw(st.integers(0, 4)) if ndim is None else ndim
    offsets = draw(st.lists(st.integers(0, 1 << 20), min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(0, 1 << 20), min_size=n, max_size=n))
    return Box(tuple(offsets), tuple(sizes))


@st.composite
def specs_and_boxes(draw: st.DrawFn) -> tuple[TensorSpec, Box]:
    """A spec and a box inside it."""
    box = draw(boxes())
    extra = draw(st.lists(st.integers(0, 64), min_size=box.ndim, max_size=box.ndim))
    name = draw(st.text(min_size=1, max_size=20))
    return TensorSpec(name, tuple(e + x for e, x in zip(box.ends, extra)), draw(DTYPES)), box


def assert_same(checked: object, fast: object) -> None:
    assert type(fast) is type(checked)
    assert vars(fast) == vars(checked)  # before hashing: a Box keeps its hash in its dict once asked
    assert fast == checked
    if type(checked).__hash__ is not None:
        assert hash(fast) == hash(checked)
    for f in dataclasses.fields(checked):  # type: ignore[arg-type]
        assert getattr(fast, f.name) == getattr(checked, f.name)


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_unchecked_boxes_are_the_checked_ones(box):
    assert_same(Box(box.offsets, box.sizes), Box.of(box.offsets, box.sizes))
    assert_same(Box(box.offsets, box.sizes), unchecked(Box)(box.offsets, box.sizes, box.ends))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4).flatmap(lambda n: st.tuples(boxes(n), boxes(n))))
def test_intersections_and_relative_boxes_are_the_checked_ones(pair):
    a, b = pair
    common = a.intersect(b)
    if common is not None:
        assert_same(Box(common.offsets, common.sizes), common)
        assert_same(Box(tuple(o - p for o, p in zip(common.offsets, a.offsets)), common.sizes), common.relative_to(a))


@settings(max_examples=200, deadline=None)
@given(specs_and_boxes(), st.sampled_from([SourcePiece, DestinationPiece]))
def test_unchecked_pieces_and_metas_are_the_checked_ones(spec_box, cls):
    spec, box = spec_box
    checked = cls(spec, box)
    assert_same(checked, cls.of(spec, box))
    assert_same(PieceMeta(spec, box), checked.meta)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20), st.integers(0, 4096), st.integers(0, 64), st.integers(0, 4096), st.integers(0, 64),
       st.integers(0, 4).flatmap(lambda n: st.tuples(boxes(n), boxes(n))), DTYPES)
def test_unchecked_transfers_are_the_checked_ones(name, src, src_piece, dst, dst_piece, pair, dtype):
    src_box, dst_box = pair
    checked = Transfer(name, src, src_piece, src_box, dst, dst_piece, dst_box, dtype)
    assert_same(checked, new_transfer(name, src, src_piece, src_box, dst, dst_piece, dst_box, dtype, None))
    assert_same(checked, new_transfer(name, src, src_piece, src_box, dst, dst_piece, dst_box, dtype))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 64), boxes(), st.integers(0, 1 << 30), DTYPES)
def test_unchecked_segments_are_the_checked_ones(piece, box, offset, dtype):
    checked = Segment(piece, box, offset, dtype)
    assert_same(checked, new_segment(piece, box, offset, dtype, None))
    assert_same(checked, new_segment(piece=piece, box=box, offset=offset, dtype=dtype))


def test_a_field_with_a_default_factory_is_refused():
    @dataclasses.dataclass
    class Listed:
        items: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="default factory"):
        unchecked(Listed)
