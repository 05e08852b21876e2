"""Quantized destination specs on the setup wire (JSON, never pickle): they travel whole, and a
malformed quantization record fails setup with a WireError naming the piece."""

from __future__ import annotations

import pytest
import torch

from refit_core.contract.errors import WireError
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, Quantization, TensorSpec
from refit_core.net import wire
from refit_core.plan import codec

NAME = "model.layers.0.mlp.experts.w13_weight"


def _meta(quant: Quantization, shape=(4, 256, 300), dtype=torch.float8_e4m3fn) -> PieceMeta:
    return PieceMeta(TensorSpec(NAME, shape, dtype, quant), Box((1, 128, 0), (2, 128, 300)))


@pytest.mark.parametrize("quant", [
    Quantization.block_fp8(NAME + "_scale_inv", experts=True),
    Quantization.per_channel(NAME + "_scale", (4, 256, 300), dtype=torch.float8_e5m2),
    Quantization.per_tensor(NAME + "_scale", (4, 256, 300), experts=True),
], ids=["block", "per-channel-e5m2", "per-tensor"])
def test_quantized_specs_round_trip_through_json(quant):
    meta = _meta(quant, dtype=quant.dtype)
    record = wire.decode(wire.encode(codec.metas_to_wire([meta])), "test")
    assert record[0]["quant"]["scale_name"] == quant.scale_name
    (back,) = codec.metas_from_wire(record, "gen rank 0")
    assert back == meta and back.spec.quant == quant


def test_plain_specs_carry_no_quant_field():
    meta = PieceMeta(TensorSpec("model.norm.weight", (128,), torch.bfloat16), Box((0,), (128,)))
    assert "quant" not in codec.meta_to_wire(meta)
    assert codec.meta_from_wire(codec.meta_to_wire(meta), "x") == meta


def _bad(**changes) -> dict:
    record = codec.meta_to_wire(_meta(Quantization.block_fp8(NAME + "_scale_inv", experts=True)))
    record["quant"].update(changes)
    return record


@pytest.mark.parametrize("record,words", [
    (_bad(scheme="blocky"), "unknown quantization scheme"),
    (_bad(block=[1, 0, 128]), "block"),
    (_bad(block=[128, 128]), "does not fit a tensor of shape"),  # rank 2 block on a 3-D tensor
    (_bad(block="128x128"), "block"),
    (_bad(dtype="bfloat16"), "not one of"),  # quantized values must be FP8
    (_bad(dtype="float8_e5m2"), "differs from its quantization"),  # spec says e4m3
    (_bad(scale_dtype="int64"), "scales"),
    (_bad(scale_name=""), "scale"),
    (_bad(scale_name=["__import__('os')"]), "scale"),
    (_bad(extra=1), "expected a quantization record"),
    ({**_bad(), "quant": None}, "expected a quantization record"),
], ids=["scheme", "block-zero", "block-rank", "block-str", "values-dtype", "dtype-mismatch", "scale-dtype",
        "scale-name-empty", "scale-name-list", "extra-field", "null"])
def test_malformed_quantization_records_are_refused(record, words):
    with pytest.raises(WireError, match="gen rank 1 piece 0") as info:
        codec.metas_from_wire([record], "gen rank 1")
    assert words in str(info.value) and NAME in str(info.value)
