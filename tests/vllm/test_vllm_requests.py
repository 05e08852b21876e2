"""What refit accepts in vLLM's weight-transfer calls, without an engine: an nccl-style ``update_info``
held against the engine's HF tensors, and a one-rank ``WeightSource``'s pass held against its metadata."""

from __future__ import annotations

import pytest

from tests.environments import require
import torch

require("refit_vllm")

from refit_vllm.held import Declared, HeldWeights
from refit_vllm.requests import InvalidRequestError, check_step, check_subset, named_tensors, step_names

from refit_core import Box, Quantization, RefitError, TensorSpec
from refit_core.contract.experts import default_expert_name
from refit_core.apps import same_bytes
from refit_core.kit import ModelPlan, PlannedPiece

CATALOG = {s.name: s for s in (
    TensorSpec("embed.weight", (8, 4), torch.bfloat16),
    TensorSpec("proj.weight", (4, 4), torch.float8_e4m3fn, Quantization.block_fp8("proj.weight_scale_inv", (2, 2))),
    TensorSpec("router.counts", (3,), torch.int64),
)}


def tensors(*rows: tuple[str, str, list[int]]) -> tuple:
    names, dtypes, shapes = zip(*rows)
    return named_tensors(list(names), list(dtypes), list(shapes))


def whole(**changes: tuple[str, list[int]]) -> tuple:
    rows = {"embed.weight": ("float32", [8, 4]), "proj.weight": ("bfloat16", [4, 4]),
            "router.counts": ("int64", [3])} | changes
    return tensors(*((name, dtype, shape) for name, (dtype, shape) in rows.items()))


def test_a_list_naming_every_tensor_passes_refit_casts_floats() -> None:
    assert check_step(whole(), CATALOG) is None  # fp32 into bf16, bf16 into a quantized fp8 tensor: refit casts


def test_a_strict_subset_is_a_subset_step_and_only_must_agree_with_names() -> None:
    subset = tensors(("embed.weight", "float32", [8, 4]))
    assert check_step(subset, CATALOG) == {"embed.weight"}
    assert step_names(subset, None, CATALOG) == step_names(None, ["embed.weight"], CATALOG) == {"embed.weight"}
    assert step_names(whole(), list(CATALOG), CATALOG) is None  # every tensor: a whole step
    for args, message in [((subset, ["proj.weight"]), r"names and only disagree on 2 tensor\(s\): embed.weight, proj"),
                          ((None, ["nope"]), r"only names 1 tensor\(s\) the engine's checkpoint does not have: nope"),
                          ((None, []), "names no tensor")]:
        with pytest.raises(InvalidRequestError, match=message):
            step_names(*args, CATALOG)


def _plan() -> ModelPlan:
    """Two fused modules as vLLM's loaders fill them (qkv from q, k, v; grouped experts), one loader tensor."""
    def piece(name: str, module: str, shape: tuple[int, ...]) -> PlannedPiece:
        return PlannedPiece(TensorSpec(name, shape, torch.float32), Box((0,) * len(shape), shape), (module, "weight"),
                            0, (1,) * len(shape))

    attn = "model.layers.0.self_attn"
    return ModelPlan(pieces=[piece(f"{attn}.{p}_proj.weight", f"{attn}.qkv_proj", (4, 4)) for p in "qkv"]
                     + [piece("model.layers.0.mlp.experts.w1.weight", "model.layers.0.mlp.experts", (2, 4, 4))],
                     loader=[TensorSpec("lm_head.weight", (8, 4), torch.float32),
                             TensorSpec("model.norm.weight", (4,), torch.float32)],
                     targets={}, fast_modules=[f"{attn}.qkv_proj", "model.layers.0.mlp.experts"])


def test_a_subset_splitting_a_module_vllm_processes_whole_is_refused_naming_it() -> None:
    plan, attn = _plan(), "model.layers.0.self_attn"
    fused = [f"{attn}.{p}_proj.weight" for p in "qkv"]
    experts = [f"model.layers.0.mlp.experts.{e}.w1.weight" for e in range(2)]
    check_subset([*fused, *experts], plan, default_expert_name, reload=True)
    check_subset(fused[:1], plan, default_expert_name, reload=False)  # direct writes: q's slice alone is fine
    with pytest.raises(InvalidRequestError, match=rf"splits 1 vLLM module\(s\) post-processed whole: "
                                                  rf"{attn}.qkv_proj \(leaves out {attn}.k_proj.weight, "
                                                  rf"{attn}.v_proj.weight\)"):
        check_subset(fused[:1], plan, default_expert_name, reload=True)
    with pytest.raises(InvalidRequestError, match="names 1 of the 2 loader-path tensors .leaves out model.norm.weight"):
        check_subset(["lm_head.weight"], plan, default_expert_name, reload=True)


def test_no_names_is_no_claim() -> None:
    assert named_tensors(None, None, None) is None


@pytest.mark.parametrize(("lists", "message"), [
    ((["a", "b"], ["float32"], [[1], [2]]), "`dtype_names` should be of the same size as `names`: got 1 and 2"),
    ((["a"], ["float32"], [[1], [2]]), "`shapes` should be of the same size as `names`: got 2 and 1"),
    ((["a"], None, [[1]]), "update_info gives names, shapes without dtype_names"),
    ((["a"], ["float33"], [[1]]), "'float33', which is not a torch dtype"),
    ((["a", "a"], ["float32"] * 2, [[1]] * 2), "update_info names a more than once"),
])
def test_malformed_lists_are_value_errors(lists: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        named_tensors(*lists)


@pytest.mark.parametrize(("claim", "message"), [
    (whole(**{"lm_head.weight": ("float32", [8, 4])}),
     "1 tensor(s) the engine's checkpoint does not have: lm_head.weight"),
    (whole(**{"embed.weight": ("float32", [4, 8])}), "embed.weight [4, 8] (the engine's is [8, 4])"),
    (whole(**{"router.counts": ("int32", [3])}), "router.counts int32 (the engine's is int64)"),
    (whole(**{"proj.weight": ("int8", [4, 4])}), "proj.weight int8 (the engine's is float8_e4m3fn)"),
])
def test_mismatches_are_named(claim: tuple, message: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_step(claim, CATALOG)
    assert message in str(caught.value) and isinstance(caught.value, ValueError)


def test_held_weights_hold_a_pass_and_name_a_source_that_disagrees_with_its_metadata() -> None:
    held = HeldWeights([Declared("a", torch.float32, (2,)), Declared("b", torch.bfloat16, (1, 3))],
                       torch.device("cpu"))
    assert [(p.spec.name, p.spec.shape, p.box.sizes) for p in held.pieces()] == [("a", (2,), (2,)),
                                                                                  ("b", (1, 3), (1, 3))]
    a, b = torch.tensor([1.0, 2.0]), torch.ones(1, 3, dtype=torch.bfloat16)
    held.fill([("a", a), ("b", b)])
    assert same_bytes(held.buffers["a"], a) and same_bytes(held.buffers["b"], b)
    for pairs, message in [
        ([("b", b), ("a", a)], "yielded 'b' where its metadata declares 'a' (parameter 0)"),
        ([("a", a.double()), ("b", b)], "yielded a as float64 [2]; its metadata declares float32 [2]"),
        ([("a", a)], "yielded 1 of the 2 parameters its metadata declares (first missing: b)"),
        ([("a", a), ("b", b), ("c", a)], "yielded 'c' after the 2 parameters"),
    ]:
        with pytest.raises(RefitError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            held.fill(pairs)
