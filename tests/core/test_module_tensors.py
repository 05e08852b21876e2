"""``refit_core.kit.ModuleTensors``: the listing a plugin's ``refit_model_tensors`` returns before every step is
always what ``named_parameters()`` then ``named_buffers()`` would give, while walking the tree only once."""

from __future__ import annotations

import torch

from refit_core.kit import ModuleTensors


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model.register_buffer("step", torch.zeros(1))
    return model


def _walked(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(f"0.{n}", t) for n, t in model.named_parameters()] + [(f"0.{n}", t) for n, t in model.named_buffers()]


def _same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(x is y for (_, x), (_, y) in zip(a, b))


def test_the_listing_is_the_walk_and_the_tree_is_walked_once() -> None:
    model = _model()
    tensors = ModuleTensors([("0", model)])
    for _ in range(5):
        assert _same(tensors(), _walked(model))
    assert tensors.walks == 1


def test_a_replaced_parameter_a_new_storage_a_replaced_submodule_and_a_deleted_tensor_all_show() -> None:
    model = _model()
    tensors = ModuleTensors([("0", model)])
    before = tensors()
    model[0].weight = torch.nn.Parameter(torch.ones(4, 4))  # replaced in its slot: read from the slot
    now = tensors()
    assert now[0][1] is model[0].weight and now[0][1] is not before[0][1] and tensors.walks == 1
    model[1].bias.data = torch.zeros(4)  # new memory, same tensor object: the caller compares addresses
    assert tensors()[3][1].data_ptr() == model[1].bias.data_ptr()
    model[2] = torch.nn.Linear(4, 2)  # a replaced submodule: walked again
    assert _same(tensors(), _walked(model)) and tensors.walks == 2
    del model[1].bias  # an emptied slot: walked again, the tensor is gone from the listing
    model[1].register_parameter("bias", None)
    assert _same(tensors(), _walked(model)) and tensors.walks == 3


def test_a_tensor_in_two_slots_is_listed_once_as_named_parameters_does() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    tensors = ModuleTensors([("0", model)])
    assert _same(tensors(), _walked(model)) and len(tensors()) == 1


def test_only_submodules_on_the_way_to_a_tensor_are_watched() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    tensors = ModuleTensors([("0", model)])
    tensors()
    model[1] = torch.nn.GELU()  # held no tensor: not watched, nothing to list anew
    assert _same(tensors(), _walked(model)) and tensors.walks == 1
    model[2][0] = torch.nn.Linear(4, 2)  # under a watched parent: walked again
    assert _same(tensors(), _walked(model)) and tensors.walks == 2
    model[2] = torch.nn.Sequential(torch.nn.Linear(4, 2))
    assert _same(tensors(), _walked(model)) and tensors.walks == 3


def test_without_buffers_a_replaced_buffer_is_no_concern() -> None:
    """``buffers=False`` lists the parameters alone: a forward that replaces a buffer (a dynamic rotary
    embedding's ``inv_freq``) changes nothing listed and walks nothing again."""
    model = _model()
    tensors = ModuleTensors([("0", model)], buffers=False)
    before = tensors()
    assert _same(before, [(f"0.{n}", t) for n, t in model.named_parameters()])
    model.step = torch.ones(1)
    assert _same(tensors(), before) and tensors.walks == 1
