"""FP8 destinations under the failure semantics of issue #11, real ranks over gloo: staged mode
stages quantized tensors (FP8 values and scales quantized on the sender, BF16 stand-ins quantized on
the receiver) and applies them only once every gen rank landed the step; a failed in-place step
names every FP8 weight and scale tensor it may have written, and no others."""

from __future__ import annotations

import pytest
from fp8_ranks import fp8_fault_rank, fp8_refit_rank

from refit_core.kit.launch import free_port, spawn

BF16 = {"dtype": "bfloat16"}


def run(fault: str, mode: str, **job):
    job = {"model": "tiny-llama", "train_tp": 1, "gen_tp": 1, "block": (128, 128), "config": BF16,
           "fault": fault, "options": {"mode": mode}, **job}
    return spawn(fp8_fault_rank, 2, f"127.0.0.1:{free_port()}", job, timeout_s=240)


def test_staged_mode_lands_sender_and_receiver_quantized_tensors_bitwise():
    """128 x 128 blocks: q/k/v are quantized on the gen rank (after the commit), o_proj and the MLP on
    the sender; two steps, every FP8 weight and scale bitwise equal to the reference quantizer's."""
    job = {"model": "tiny-llama", "train_tp": 1, "gen_tp": 1, "block": (128, 128), "config": BF16,
           "bucket_bytes": 64 << 10, "options": {"mode": "staged"}}
    results = spawn(fp8_refit_rank, 2, f"127.0.0.1:{free_port()}", job, timeout_s=240)
    gen = results[1]
    assert "error" not in gen and gen["mismatches"] == [] and gen["version"] == 1, gen
    assert gen["receiver_quantized"] and results[0]["sender_quantized"]


def _scale(name: str) -> str:
    return name + "_scale_inv"


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_a_transport_failure_mid_step_reports_exactly_what_it_tore(mode):
    """The gen rank's transport fails half-way through the step's 64 KiB rounds. In place:
    every FP8 weight or scale that changed is named torn, the receiver-quantized q/k/v (whose bytes
    land in BF16 stand-ins, quantized only after the whole step) are neither torn nor changed. Staged:
    nothing changed, nothing is torn."""
    train, gen = run("exchange", mode)
    assert gen["error"] == "StepFailedError" and gen["version"] == 0, gen
    assert "injected: the transport failed mid-step" in gen["message"], gen["message"]
    assert "error" in train, train  # the sender sees the gen rank's transport close
    state, torn = gen["state"], set(gen["torn"])
    changed = {name for name, s in state.items() if s != "old"}
    if mode == "staged":
        assert torn == set() and changed == set(), (torn, changed)
        return
    assert changed and changed <= torn, (changed, torn)
    assert any(n.endswith("_scale_inv") for n in torn) and any(n.endswith("_proj.weight") for n in torn), torn
    receiver_quantized = set(gen["receiver_quantized"])
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"} <= receiver_quantized
    untouched = receiver_quantized | {_scale(n) for n in receiver_quantized}
    assert not torn & untouched, torn & untouched
    assert all(state[n] == "old" for n in untouched), {n: state[n] for n in untouched}


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_a_receiver_quantizer_failure_tears_the_quantized_weights_and_scales(mode):
    """Every byte landed (and, staged, every gen rank agreed), then the gen rank's quantizer fails
    after its first tensor: the receiver-quantized weights and their scales are named torn, one of
    them is new, and every changed tensor is named."""
    train, gen = run("quantize", mode)
    assert gen["error"] == "StepFailedError", gen
    assert "injected: the receiver-side quantizer failed" in gen["message"], gen["message"]
    state, torn = gen["state"], set(gen["torn"])
    receiver_quantized = set(gen["receiver_quantized"])
    assert receiver_quantized | {_scale(n) for n in receiver_quantized} <= torn, torn
    changed = {name for name, s in state.items() if s != "old"}
    assert changed <= torn, (changed, torn)
    assert sum(state[n] == "new" for n in receiver_quantized) == 1, {n: state[n] for n in receiver_quantized}
