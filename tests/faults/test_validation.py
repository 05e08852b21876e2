"""Bind-time view checks, the wire schema and the serving guard, in-process (fast)."""

import pytest
import torch

from refit_core.contract.errors import WireError
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.guard import TornWeightsError, refuse_serving, resume_serving, torn_tensors
from refit_core.net.wire import decode
from refit_core.plan.codec import meta_to_wire, metas_from_wire
from refit_core.run.validate import ViewError, check_no_overlap, check_view

SPEC = TensorSpec("w", (4, 6), torch.float32)
BOX = Box((0, 0), (4, 6))


@pytest.mark.parametrize("view,match", [
    (torch.zeros(4, 5), "view shape"),
    (torch.zeros(4, 6, dtype=torch.float16), "view dtype"),
    (torch.zeros(1, 6).expand(4, 6), "stride-0"),
    (torch.empty(4, 6, device="meta"), "meta device"),
    ([[0.0] * 6] * 4, "not a tensor"),
])
def test_a_changed_or_unusable_destination_view_is_refused(view, match):
    with pytest.raises(ViewError, match=match):
        check_view(SPEC, BOX, view, destination=True)


def test_views_that_interleave_without_sharing_bytes_pass_and_shared_bytes_fail():
    w = torch.zeros(8, 6)
    check_no_overlap(["a", "b"], [w[:, :3], w[:, 3:]])  # column halves interleave in memory
    check_no_overlap(["q", "k", "v"], [w[:2], w[2:5], w[5:]])
    for views in ([w[:, :4], w[:, 3:]], [w[:4], w[3:]], [w, w[7:]], [w[:, 0], w.view(-1)[::6]]):
        with pytest.raises(ViewError, match="shares memory"):
            check_no_overlap(["a", "b"], views)


@pytest.mark.parametrize("record,match", [
    ({"name": 5, "shape": [4], "dtype": "float32", "offsets": [0], "sizes": [4]}, "not a non-empty string"),
    ({"name": "w", "shape": [True], "dtype": "float32", "offsets": [0], "sizes": [1]}, "not an integer"),
    ({"name": "w", "shape": [10 ** 30], "dtype": "float32", "offsets": [0], "sizes": [1]}, "not an integer"),
    ({"name": "w", "shape": [4], "dtype": "complex128", "offsets": [0], "sizes": [4]}, "unknown dtype"),
    ({"name": "w", "shape": [4], "dtype": "float32", "offsets": [2], "sizes": [4]}, "outside shape"),
    ({"name": "w", "shape": [4], "dtype": "float32", "offsets": [0], "sizes": [4], "x": 1}, "piece record"),
])
def test_the_wire_schema_rejects_malformed_piece_metadata(record, match):
    with pytest.raises(WireError, match=match):
        metas_from_wire([record], "gen rank 0")


def test_the_wire_round_trips_metadata_and_rejects_non_json():
    meta = PieceMeta(TensorSpec("model.w", (3, 5), torch.bfloat16), Box((1, 0), (2, 5)))
    assert metas_from_wire([meta_to_wire(meta)], "x") == [meta]
    with pytest.raises(WireError, match="not refit data"):
        decode(b"\x80\x04\x95pickle", "x")
    with pytest.raises(WireError, match="not refit data"):
        decode(b"[NaN]", "x")


def test_a_refused_module_raises_until_it_is_resumed():
    layer = torch.nn.Linear(2, 2)
    refuse_serving(layer, ["layer.weight"])
    with pytest.raises(TornWeightsError, match="layer.weight"):
        layer(torch.zeros(1, 2))
    assert torn_tensors(layer) == {"layer.weight"}
    resume_serving(layer)
    assert layer(torch.zeros(1, 2)).shape == (1, 2) and not torn_tensors(layer)


def test_a_string_dtype_is_named_with_the_torch_dtype_it_means():
    expected = r"TensorSpec 'w': dtype 'float32' is a str, not a torch.dtype \(torch.float32\)"
    with pytest.raises(TypeError, match=expected):
        TensorSpec("w", (2, 2), "float32")
