"""The load tracer follows loaders that concatenate checkpoint tensors (``torch.cat``) into one parameter.

SGLang's DeepSeek-V3 loader caches ``q_a_proj`` and ``kv_a_proj_with_mqa`` and writes
``torch.cat([q_a, kv_a])`` into ``fused_qkv_a_proj_with_mqa``; the toy loaders below do the same
(whole, row-sliced after the concatenation, transposed) and the traced plan, replayed as plain box
copies, must reproduce what the real loader writes bit for bit. And a traced loader leaves no
tensor it set as a plain attribute behind on the live model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

from refit_core import TensorSpec
from refit_core.apps import same_bytes
from refit_core.kit.loadplan import plan_model
from refit_core.kit.loadtrace import trace_loads

Q, KV, HIDDEN = 6, 4, 5
SPECS = [TensorSpec("a.q.weight", (Q, HIDDEN), torch.float32), TensorSpec("a.kv.weight", (KV, HIDDEN), torch.float32),
         TensorSpec("norm.weight", (HIDDEN,), torch.float32)]


class Fused(torch.nn.Module):
    """One parameter loaded from the concatenation of ``a.q.weight`` and ``a.kv.weight``."""

    def __init__(self, shape: tuple[int, ...], write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]):
        super().__init__()
        self.fused = torch.nn.Linear(1, 1, bias=False)
        self.fused.weight = torch.nn.Parameter(torch.zeros(shape))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.write = write

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cached: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name == "norm.weight":
                self.norm.weight.data.copy_(tensor)
                continue
            cached[name] = tensor
            if len(cached) == 2:
                self.write(self.fused.weight.data, cached["a.q.weight"], cached["a.kv.weight"])


def _whole(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
    param.copy_(torch.cat([q, kv], dim=0))


def _rank1_of_2(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
    """Rows 5..9 of the concatenation: the end of q and all of kv (a slice spanning both)."""
    param.copy_(torch.cat([q, kv])[5:])


def _transposed(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
    param.copy_(torch.cat([q, kv], dim=0).t())


def _columns(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
    """Concatenated along dim 1 (AWQ's layout), columns 3..6 kept: two of q, two of kv."""
    param.copy_(torch.cat([q[:KV], kv], dim=1)[:, 3:7])


def _reconcatenated(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
    """Slices of a concatenation concatenated again (SGLang's fused LoRA B, cut per TP rank): rows 1..3
    of q, then rows 7..9 (the end of kv)."""
    fused = torch.cat([q, kv])
    param.copy_(torch.cat([fused[1:4], fused[Q + 1:]]))


def _cloned_columns(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
    """Contiguous copies of column slices (SGLang's row-parallel LoRA A, cut per TP rank), concatenated."""
    param.copy_(torch.cat([q[:, 1:4].contiguous(), kv[:, 1:4].contiguous()]))


CASES = {"whole": ((Q + KV, HIDDEN), _whole), "spanning-slice": ((Q + KV - 5, HIDDEN), _rank1_of_2),
         "transposed": ((HIDDEN, Q + KV), _transposed), "other-dim": ((KV, 4), _columns),
         "re-concatenated": ((3 + KV - 1, HIDDEN), _reconcatenated), "cloned-slices": ((Q + KV, 3), _cloned_columns)}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen) for s in SPECS}


def _plan(model: Fused):
    return plan_model(model, list(SPECS), namer=lambda name: None, tracer=trace_loads, fast_quant_methods=())


@pytest.mark.parametrize("case", list(CASES))
def test_concatenated_writes_are_traced_per_checkpoint_tensor_and_replay_bitwise(case: str) -> None:
    shape, write = CASES[case]
    model, reference = Fused(shape, write), Fused(shape, write)
    plan = _plan(model)
    assert plan.loader == [] and plan.loader_reasons == {}, plan.loader_reasons
    assert {p.spec.name for p in plan.pieces} == {s.name for s in SPECS}
    weights = _weights(7)
    reference.load_weights(weights.items())
    with torch.no_grad():
        for piece in plan.pieces:
            tensor = model.get_submodule(piece.target[0]).get_parameter(piece.target[1])
            view = tensor.detach().as_strided(piece.box.sizes, piece.strides, tensor.storage_offset() + piece.offset)
            view.copy_(piece.box.slice_of(weights[piece.spec.name]))
    assert same_bytes(model.fused.weight, reference.fused.weight)
    assert same_bytes(model.norm.weight, reference.norm.weight)


def test_a_computed_concatenation_takes_the_loader_path_with_every_tensor_it_read() -> None:
    """A concatenation of something computed (here q scaled) is no box copy: the module goes to the
    loader path and both q and kv follow it (crediting only the last one read would report the other
    as loading into nothing)."""
    def scaled(param: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> None:
        param.copy_(torch.cat([q * 2, kv]))

    plan = _plan(Fused((Q + KV, HIDDEN), scaled))
    assert sorted(s.name for s in plan.loader) == ["a.kv.weight", "a.q.weight"]
    assert "fused" in plan.loader_reasons and plan.skipped == {}
    assert [p.spec.name for p in plan.pieces] == ["norm.weight"]


def test_tensors_a_traced_loader_sets_as_attributes_are_put_back() -> None:
    """SGLang's DeepSeek ``post_load_weights`` (run at the end of its ``load_weights``) sets ``w_kc``
    from ``kv_b_proj``: traced, that is a meta tensor, which must not stay on the live model."""
    class Derives(Fused):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(weights)
            self.w_kc = self.fused.weight.detach().t().contiguous()
            self.fused.scale = torch.ones(1)

    model = Derives((Q + KV, HIDDEN), _whole)
    model.w_kc = None
    _plan(model)
    assert model.w_kc is None and not hasattr(model.fused, "scale")
    model.load_weights(_weights(3).items())
    kept = model.w_kc
    _plan(model)
    assert model.w_kc is kept and not kept.is_meta
