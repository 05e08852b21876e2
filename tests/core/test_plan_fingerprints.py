"""Plan fingerprints are stable: the same models, layouts and settings plan to the same fingerprint as before.

A fingerprint is what every rank agrees on at setup and checks in every step's header, so a change to it
means a changed plan (other messages, rounds or settings on the wire). The values below were computed at
d97d313 (before the 0.3 rooms-and-seams refactor) from metadata alone; a refactor that only moves code
must leave every one of them as it is. A deliberate plan change updates them, with the reason in its commit.
"""

from __future__ import annotations

import pytest
import torch

from refit_core import RefitOptions
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.lora import LoraMode, LoraSpec
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.spec import Box, Quantization, TensorSpec
from refit_core.kit.models import load_config
from refit_core.plan.offline import plan_from_metadata
from refit_core.plan.planning import plan_with_relay

LAYOUTS = [  # model, train, gen, device, options, LoRA adapter mode, fingerprint at d97d313
    ("tiny-llama", "dtensor:fsdp=2", "vllm:tp=2", "cpu", {}, False, "8c7f72636e1b2cfc"),
    ("tiny-llama", "megatron:tp=2,pp=2", "vllm:tp=1,dp=2", "cuda", {}, False, "5b2830f5a54123bf"),
    ("tiny-qwen3-moe", "megatron:tp=2,ep=2", "vllm:tp=2", "cuda", {}, False, "82afecbd931f1874"),
    ("tiny-qwen3-moe", "dtensor:fsdp=2,tp=2", "sglang:tp=2", "cpu", {}, False, "ea7623e04b28afdc"),
    ("tiny-mixtral", "megatron:dp=2,ep=2", "vllm:tp=2", "cpu", {"mode": "staged"}, False, "62251710acaa648a"),
    ("llama-3-8b-shape", "megatron:tp=2", "vllm:tp=1,dp=2", "cuda", {"relay": {"replicas": 2}}, False,
     "fa84f9bce02a141f"),
    ("tiny-llama", "dtensor:fsdp=2", "vllm:tp=2", "cpu", {}, True, "7b652286db6c9f5b"),
]


@pytest.mark.parametrize("model, train, gen, device, options, adapter, fingerprint", LAYOUTS,
                         ids=[f"{m}-{t}-{g}{'-lora' if a else ''}" for m, t, g, _, _, a, _ in LAYOUTS])
def test_plans_from_metadata_keep_their_fingerprints(model, train, gen, device, options, adapter, fingerprint):
    train_backend, train_layout = parse_backend_layout(train)
    gen_backend, gen_layout = parse_backend_layout(gen)
    lora = LoraSpec(rank=8, alpha=16, mode=LoraMode.ADAPTER) if adapter else None
    summary = plan_from_metadata(get_plugin_manager(), load_config(model), train_backend, train_layout, gen_backend,
                                 gen_layout, options=RefitOptions(**options), device=device, lora=lora)
    assert summary.schedule.fingerprint == fingerprint


@pytest.mark.parametrize("rows_on_rank_0, fingerprint", [(512, "689bb49a8b85bea3"), (320, "ad5071e1bb316d3b")],
                         ids=["sender-quantizes", "receiver-quantizes"])
def test_fp8_plans_keep_their_fingerprints(rows_on_rank_0, fingerprint):
    """Two trainers into two block-FP8 engines: whole 128-row blocks per trainer (the sender quantizes), or
    blocks split between trainers (the receiver quantizes)."""
    block = Quantization.block_fp8("w_scale_inv", (128, 128))
    shape = (1024, 2048)
    high, low = TensorSpec("w", shape, torch.bfloat16), TensorSpec("w", shape, torch.float8_e4m3fn, block)
    whole = Box((0, 0), shape)
    cuts = [0, rows_on_rank_0, shape[0]]
    train = [[PieceMeta(high, Box((a, 0), (b - a, shape[1])))] for a, b in zip(cuts, cuts[1:])]
    gen = [[PieceMeta(low, whole), PieceMeta(block.scale_spec(shape), block.scale_box(whole))] for _ in range(2)]
    schedule, _ = plan_with_relay(train, gen, RefitOptions(bucket_bytes=1 << 20).resolved("cuda"))
    assert schedule.fingerprint == fingerprint
