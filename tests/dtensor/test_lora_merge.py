"""The pack step's merge (:class:`refit_core.run.merge.Deltas`, :func:`~refit_core.run.merge.merged_box`)
against PEFT's ``merge_and_unload()``, box by box (narrow column blocks too, whose own GEMM would round
differently), for the factor dtypes PEFT treats differently (fp32; bf16 upcast to fp32 on CPU)."""

import copy

import pytest
import torch
from lora_ranks import peft_model

from tests.environments import require

from refit_core import LoraFactors, LoraMerge
from refit_core.apps import same_bytes
from refit_core.run.merge import BoxToMerge, Deltas, merged_box

require("peft")

BOXES = [(slice(None), slice(None)), (slice(0, 37), slice(5, 128)), (slice(37, None), slice(0, 5))]


@pytest.mark.parametrize("base,adapter", [("float32", "float32"), ("bfloat16", "float32"),
                                          ("bfloat16", "bfloat16")])
def test_merged_boxes_equal_merge_and_unload_bitwise(base, adapter):
    model = peft_model(5, dtype=getattr(torch, base))
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.data = param.data.to(getattr(torch, adapter))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    checked = 0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        factors = LoraFactors(module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach())
        weight = module.base_layer.weight.detach()
        want = merged[name.removeprefix("base_model.model.") + ".weight"]
        merge = LoraMerge(name, module.scaling["default"], None)
        boxes = [BoxToMerge(weight[rows, cols], merge, rows, cols, weight.dtype, (), (), 0) for rows, cols in BOXES]
        deltas = Deltas(boxes)
        deltas.begin({name: factors})
        for box in boxes:
            got = merged_box(box.source, deltas.of(box))
            assert got.dtype == weight.dtype and same_bytes(got, want[box.rows, box.cols]), (name, box.rows, box.cols)
            checked += 1
        assert not deltas.live  # the module's delta is dropped after its last box
    assert checked == 2 * 7 * len(BOXES)
