"""The destination overlap check's fast path (contiguous blocks, sorted) agrees with counting bytes."""

import random

import pytest
import torch

from refit_core.run import validate
from refit_core.run.validate import ViewError, check_no_overlap


def _random_view(base: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A random in-bounds strided view of ``base`` (1 to 3 dims, positive strides, may overlap itself)."""
    while True:
        dims = rng.randint(1, 3)
        shape = [rng.randint(1, 4) for _ in range(dims)]
        stride = [rng.randint(1, 12) for _ in range(dims)]
        offset = rng.randint(0, 40)
        if offset + sum((n - 1) * st for n, st in zip(shape, stride)) < base.numel():
            return base.as_strided(shape, stride, offset)


def _outcome(names: list[str], views: list[torch.Tensor]) -> str:
    try:
        check_no_overlap(names, views)
    except ViewError as e:
        return str(e)
    return "disjoint"


def test_the_block_check_and_byte_counting_agree_on_random_views(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    base = torch.zeros(96, dtype=torch.bfloat16)
    outcomes = set()
    for _ in range(400):
        views = [_random_view(base, rng) for _ in range(rng.randint(2, 4))]
        names = [f"v{i}" for i in range(len(views))]
        fast = _outcome(names, views)
        with monkeypatch.context() as m:
            m.setattr(validate, "BLOCKS_AT_MOST", 0)  # every cluster counted byte by byte
            counted = _outcome(names, views)
        assert fast == counted
        outcomes.add(fast == "disjoint")
    assert outcomes == {True, False}  # both verdicts were exercised


def test_fused_halves_of_a_large_stack_pass_without_counting_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    w13 = torch.empty(128, 768, 2048, dtype=torch.bfloat16)  # untouched: address space only
    zeros = torch.zeros

    def small_zeros(*size: int, **kwargs: object) -> torch.Tensor:
        assert size[0] < 1 << 20, "the byte counter's buffer (one byte per byte of the stack) was made"
        return zeros(*size, **kwargs)

    monkeypatch.setattr(torch, "zeros", small_zeros)
    check_no_overlap(["gate", "up"], [w13[:, :384], w13[:, 384:]])
