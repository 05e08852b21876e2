"""Block-FP8 SGLang destinations (issue #15): SGLang's real Qwen3 / Qwen3-MoE model classes, built on
CPU with its block-FP8 config (128 x 128, e4m3 weights, fp32 ``weight_scale_inv``), refitted twice
from a BF16 FSDP2 trainer through SGLang's real weight-update session. refit quantizes the trainer's
weights (on the sender: every transfer holds whole blocks) and hands FP8 values and scales to
SGLang's own ``load_weights`` (the loader path: SGLang's FP8 methods are not plain copies). After
each step every parameter equals, bit for bit, what SGLang's ``load_weights`` makes of the checkpoint
refit's reference quantizer produces from the same BF16 weights.

Not covered: SGLang's Llama (0.5.23's ``LlamaForCausalLM.load_weights`` renames ``weight_scale_inv``
to ``weight_scale``, which its block-FP8 layers do not have, so SGLang itself cannot load such a
checkpoint), TP 2 (these tiny models' K/V rows would split blocks, which SGLang refuses), and
SGLang's post-load FP8 processing (``process_weights_after_loading``; CUDA kernels).
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("sglang")

from sglang_fp8_ranks import STEPS, fp8_ranks

from refit_core.kit.launch import free_port, spawn

PRESETS = ["tiny-qwen3", "tiny-qwen3-moe"]
TRAIN = 2


@pytest.fixture(scope="module")
def results():
    out = spawn(fp8_ranks, TRAIN + 1, TRAIN, [free_port(), free_port()], [free_port() for _ in PRESETS],
                PRESETS, timeout_s=500)
    return out[:TRAIN], out[TRAIN]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_two_refits_equal_sglang_load_weights_of_the_reference_quantized_checkpoint(results, preset):
    train, gen = results
    checks = gen[preset]
    assert checks["fp8_params"], "the SGLang model holds no float8 parameters"
    assert any("self_attn.q_proj.weight" in n for n in checks["quantized"]), checks["quantized"]
    if preset.endswith("moe"):
        assert any(".experts." in n for n in checks["loader_quantized"]), checks["loader_quantized"]
    assert set(checks["loader_quantized"]) <= set(checks["loader_path"])
    assert {n + "_scale_inv" for n in checks["loader_quantized"]} <= set(checks["loader_path"])
    for step in STEPS:
        assert all(ok for _, ok, _ in checks[f"session_{step}"]), checks[f"session_{step}"]
        assert checks[f"error_{step}"] is None, checks[f"error_{step}"]
        assert checks[f"mismatch_{step}"] == [], f"step {step}: {checks[f'mismatch_{step}']}"
    assert checks[f"fp8_changed_{STEPS[-1]}"], "the second step changed no FP8 weight"
    for rank in train:
        assert all(rank[preset]["sent"][s] > 0 for s in STEPS)
