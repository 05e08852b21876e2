""""Bitwise" means bytes: ``same_bytes`` and every check built on it (``mismatches``, the kit's reference
engine) see a zero of the other sign and a NaN of another payload, which ``torch.equal`` does not."""

from __future__ import annotations

import pytest
import torch

from tests.environments import BY_DESIGN
from refit_core import Box, DestinationPiece, TensorSpec
from refit_core.apps import mismatches, same_bytes
from refit_core.testing.reference import ReferenceEngine

QUIET_NAN = 0x7FC00000
"""float32's default NaN; ``QUIET_NAN + 1`` is a NaN too, with another payload."""


def _f32(words: list[int]) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int32).view(torch.float32)


def _reference() -> torch.Tensor:
    return torch.tensor([[1.5, 0.0, -2.0], [0.0, 3.0, 4.0]])


def _negative_zero() -> torch.Tensor:
    """The reference with one 0.0 turned into -0.0: the same values, other bytes."""
    planted = _reference()
    planted[1, 0] = -0.0
    return planted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_zero_of_the_other_sign_differs(dtype):
    reference, planted = _reference().to(dtype), _negative_zero().to(dtype)
    assert torch.equal(planted, reference)  # the old check passes the defect
    assert not same_bytes(planted, reference) and same_bytes(reference, reference.clone())


def test_a_nan_equals_only_a_nan_of_the_same_payload():
    nan, other_nan = _f32([QUIET_NAN, 0]), _f32([QUIET_NAN + 1, 0])
    assert other_nan[0].isnan()
    assert not torch.equal(nan, nan.clone())  # the old check fails correct weights...
    assert same_bytes(nan, nan.clone())
    assert not same_bytes(other_nan, nan)  # ...and cannot tell payloads apart


def test_fp8_and_bool_compare_by_bytes():
    planted = torch.zeros(4, dtype=torch.float8_e4m3fn)
    planted.view(torch.uint8)[2] = 0x80  # -0.0 in e4m3
    assert not same_bytes(planted, torch.zeros(4, dtype=torch.float8_e4m3fn))
    assert same_bytes(planted, planted.clone())
    assert same_bytes(torch.tensor([True, False]), torch.tensor([True, False]))
    assert not same_bytes(torch.tensor([True, False]), torch.tensor([True, True]))


def test_dtype_shape_and_strides():
    reference = _reference()
    assert not same_bytes(reference, reference.to(torch.float64))  # equal values, another dtype
    assert not same_bytes(reference, reference.reshape(3, 2))
    transposed = reference.t()  # strided: compared element by element, not by storage
    assert same_bytes(transposed, reference.t().contiguous())
    assert not same_bytes(transposed, _negative_zero().t())
    assert same_bytes(torch.tensor(-0.0), torch.tensor(-0.0)) and not same_bytes(torch.tensor(-0.0), torch.tensor(0.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{BY_DESIGN}needs CUDA")
def test_a_cuda_tensor_compares_with_a_host_one():
    assert same_bytes(_reference().cuda(), _reference())
    assert not same_bytes(_negative_zero().cuda(), _reference())


def test_mismatches_names_the_tensor_whose_zero_changed_sign():
    spec = TensorSpec("model.layers.0.mlp.down_proj.weight", (2, 3), torch.float32)
    other = TensorSpec("model.norm.weight", (3,), torch.float32)
    reference = {spec.name: _reference(), other.name: torch.tensor([1.0, 0.0, 2.0])}
    pieces = [DestinationPiece(spec, Box((0, 0), (2, 3)), _negative_zero()),
              DestinationPiece(other, Box.full(other.shape), reference[other.name].clone())]
    assert mismatches(pieces, reference) == [f"{spec.name}{Box((0, 0), (2, 3))}"]
    nan_payload = _f32([QUIET_NAN + 1, 0, 0x40000000])  # the reference's [1, 0, 2] with a NaN of its own
    assert mismatches([DestinationPiece(other, Box.full(other.shape), nan_payload)],
                      {other.name: _f32([QUIET_NAN, 0, 0x40000000])}) == [f"{other.name}{Box.full(other.shape)}"]
    pieces[0].view.copy_(_reference())  # the fixed destination passes
    assert mismatches(pieces, reference) == []


def test_the_kit_reference_engine_sees_the_sign_of_a_zero():
    spec = TensorSpec("w", (2, 3), torch.float32)
    engine = ReferenceEngine([spec], rank=0, world=1)
    engine.tensors["w"].copy_(_negative_zero())
    assert engine.differences({"w": _reference()}) == [f"w{engine.boxes['w']}"]
    assert engine.differences({"w": _negative_zero()}) == []
