"""Adapter mode into SGLang's real LoRA manager and memory pool on CPU: a PEFT adapter's tensors land in
the pool's slot buffers (``refit_sglang.lora``) over a real refit, two versions, each checked byte for
byte against what SGLang's own adapter loader puts in a slot, and SGLang's own LoRA forward (torch_native
LoRA backend) against HF transformers running the PEFT model; a failed step's restore, registration once,
and the bad inputs refused at setup naming what is wrong, on every TP worker of a TP-2 engine (column-parallel
B and the fused q/k/v B cut per rank, row-parallel A). Not run here: a served engine (its kernels need CUDA)."""

from __future__ import annotations

from tests.environments import require

require("sglang")

from sglang_forward import LOGITS_TOLERANCE
from sglang_lora_ranks import STEPS, lora_ranks

from refit_core.kit.launch import free_port, spawn

TP = 2


def test_adapter_refits_land_in_sglangs_lora_slots_as_its_own_loader_puts_them() -> None:
    train, *workers = spawn(lora_ranks, 1 + TP, free_port(), free_port(), timeout_s=150)
    assert train == {}
    for worker, gen in enumerate(workers):
        _check_worker(worker, gen)


def _check_worker(worker: int, gen: dict) -> None:
    for step, got in zip(STEPS, gen["steps"]):
        assert got["version"] == got["target_version"] == step
        assert got["differ"] == [], f"worker {worker}, step {step}: slots differ from SGLang's own loader: " \
            f"{got['differ']}"
        assert got["slot"] != got["reference_slot"]
        assert got["nonzero"] == got["reference_nonzero"] > 0, "the check could not fail"
        assert got["bytes"] == 4 * got["nonzero"]  # this worker's fp32 adapter bytes, nothing else
        peft = got["peft"]
        assert peft["rel_diff"] < LOGITS_TOLERANCE and peft["same_argmax"], f"step {step}: SGLang vs HF + PEFT {peft}"
        assert peft["differs_from_base"], "the adapter changed no logit: the check could not fail"
    assert gen["restored"], "a failed step's restore left other bytes in the slot"
    assert gen["again"] == {"slot": True, "loaded": True}, "a second session for the name registered it again"
    refused = gen["refused"]
    assert "refit adapter 'wide': rank r=16 exceeds the engine's max_lora_rank=8" in refused["rank"]
    assert "refit adapter 'alien': target module(s) ['w_pack'] are not LoRA targets of this SGLang engine" \
        in refused["targets"]
    assert "refit adapter 'policy' is registered in this engine with r=8" in refused["shape"]
    assert refused["second"] is None  # a second pinned adapter fits: SGLang keeps 1 of 3 slots unpinned
    assert "refit adapter 'third': no LoRA slot left: SGLang keeps one of its 3 (max_loras_per_batch) unpinned and " \
        "['policy', 'second'] are pinned; start SGLang with --max-loras-per-batch >= 4" in refused["slots"]
    assert "SGLang stacks q_proj/k_proj/v_proj into qkv_proj and needs ['q_proj']" in refused["stacking"]
