"""Real refits into SGLang's real model classes on CPU, driven by SGLang's own weight-update session.

Each layout is one spawn: FSDP2 trainer ranks (refit's DTensor plugin) and the TP workers of one
SGLang "engine" (SGLang's parallel state over gloo, its model classes, its scheduler-side
``SchedulerWeightUpdaterManager`` and model-runner ``WeightUpdater`` running refit's custom loader:
see ``sglang_ranks.py`` for the thin stand-ins around them). Per model, two refits with different
weights; after each, every SGLang parameter must equal, bit for bit, what SGLang's own
``load_weights`` makes of the same HF weights, and SGLang's own forward of the refitted model (one
prefill batch, its ``torch_native`` attention backend: ``sglang_forward.py``) must give HF
transformers' next-token logits. Not run here: a real SGLang engine (CUDA-only) and its HTTP server.
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("sglang")

from layout_runs import once_per_layout
from sglang_forward import LOGITS_TOLERANCE
from sglang_ranks import LOADER_SUFFIX, STEPS, refit_ranks

from refit_core.kit.launch import free_port, spawn

PRESETS = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]
LOADER_CASE = "tiny-qwen3-moe" + LOADER_SUFFIX  # experts and qkv forced through SGLang's load_weights
CASES = PRESETS + [LOADER_CASE]
# name: (train ranks (FSDP2), SGLang TP size, with the mismatched-trainer case)
LAYOUTS = {"fsdp2-to-sglang-tp1": (2, 1, True), "fsdp2-to-sglang-tp2": (2, 2, False)}


@pytest.fixture(scope="module")
def runs():
    def launch(layout: str) -> tuple[list, list]:
        train, tp, mismatch = LAYOUTS[layout]
        results = spawn(refit_ranks, train + tp, train, [free_port(), free_port()],
                        [free_port() for _ in CASES], CASES, free_port() if mismatch else None,
                        timeout_s=500)
        return results[:train], results[train:]
    return once_per_layout(launch)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", CASES)
def test_two_refits_equal_sglang_load_weights_bitwise(runs, layout: str, preset: str) -> None:
    train, gen = runs(layout)
    for rank, result in enumerate(gen):
        checks = result[preset]
        assert checks["differs_before"], f"gen rank {rank}: the engine already held the weights"
        for step in STEPS:
            assert all(ok for _, ok, _ in checks[f"session_{step}"]), checks[f"session_{step}"]
            assert checks[f"error_{step}"] is None, checks[f"error_{step}"]
            assert checks[f"mismatch_{step}"] == [], f"gen rank {rank} step {step}: {checks[f'mismatch_{step}']}"
            logits = checks[f"logits_{step}"]
            assert logits["rel_diff"] < LOGITS_TOLERANCE and logits["same_argmax"], f"step {step}: {logits}"
        assert checks["versions"] == [str(s) for s in STEPS]
        assert checks["flushes"] == len(STEPS)
    for rank, sent in enumerate(train):
        assert all(sent[preset][s] > 0 for s in STEPS), f"train rank {rank} sent nothing"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", PRESETS)
def test_fast_path_everywhere_and_live_pieces_equal_metadata_layout(runs, layout: str, preset: str) -> None:
    """The traced destination map writes every tensor in place (no loader path for these models) and
    agrees with ``refit plan``'s metadata-only SGLang layout, rank by rank."""
    _, gen = runs(layout)
    for result in gen:
        assert result[preset]["loader_path"] == []
        assert result[preset]["live_equals_metadata_layout"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forced_loader_path_goes_whole_through_sglang_load_weights(runs, layout: str) -> None:
    """Experts and q_proj forced onto the loader path: their fused partners (k, v) follow, whole
    grouped experts arrive, and the rest stays on the fast path."""
    _, gen = runs(layout)
    for result in gen:
        loader = result[LOADER_CASE]["loader_path"]
        assert any(".experts." in name for name in loader), loader
        assert {n.rsplit(".", 2)[-2] for n in loader if "self_attn" in n} == {"q_proj", "k_proj", "v_proj"}
        assert "model.embed_tokens.weight" not in loader
        assert result[LOADER_CASE]["live_equals_metadata_layout"]


@pytest.mark.slow
def test_mismatched_trainer_fails_setup_on_every_rank_and_the_engine_keeps_serving(runs) -> None:
    """The trainer's ranks raise a PlanError naming the tensors; the SGLang worker keeps the error
    (a custom loader that raised would take SGLang's scheduler down), its session opens and closes,
    and its weights are untouched."""
    train, gen = runs("fsdp2-to-sglang-tp1")
    for rank, result in enumerate(train):
        kind, message = result["mismatch"]
        assert kind == "PlanError", f"train rank {rank}: {kind}: {message}"
        assert "mlp.gate_proj.weight" in message, message
    for result in gen:
        assert [ok for _, ok, _ in result["mismatch"]["session"]] == [True, True, True]
        assert result["mismatch"]["error"].startswith("PlanError") and "mlp" in result["mismatch"]["error"]
        assert result["mismatch"]["unchanged"], "a failed setup must not touch the engine's weights"
