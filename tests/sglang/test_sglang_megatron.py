"""Megatron -> SGLang: real refits from megatron-core ranks into SGLang's real model classes on CPU.

Two megatron-core ranks over gloo (refit's Megatron plugin; TP 2, and TP 2 x EP 2 for the MoE)
refit the TP workers of one SGLang "engine" (its parallel state over gloo, its model classes, its
scheduler-side weight-update session running refit's custom loader) twice; after each step every
SGLang parameter must equal, bit for bit, what SGLang's own ``load_weights`` makes of the HF
tensors megatron's own ``sharded_state_dict()`` describes (see ``megatron_sglang_ranks.py``), and
SGLang's own forward of the refitted model must give HF transformers' logits for those tensors.
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("sglang")
require("megatron.core")

from layout_runs import once_per_layout
from megatron_sglang_ranks import MODELS, STEPS, refit_ranks
from sglang_forward import LOGITS_TOLERANCE

from refit_core.kit.launch import spawn

TRAIN_WORLD = 2
ENGINES = {"megatron-tp2-to-sglang-tp1": 1, "megatron-tp2-to-sglang-tp2": 2}
"""Layout name -> SGLang TP size."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_ranks import listen_port

    def launch(layout: str) -> tuple[list, list]:
        tp = ENGINES[layout]
        models = list(MODELS)
        results = spawn(refit_ranks, TRAIN_WORLD + tp, TRAIN_WORLD, [listen_port(), listen_port()],
                        [listen_port() for _ in models], models, str(tmp_path_factory.mktemp(layout)),
                        timeout_s=600)
        return results[:TRAIN_WORLD], results[TRAIN_WORLD:]
    return once_per_layout(launch)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ENGINES))
@pytest.mark.parametrize("model", list(MODELS))
def test_two_megatron_refits_equal_sglang_load_weights_bitwise(runs, layout: str, model: str) -> None:
    train, gen = runs(layout)
    for rank, result in enumerate(gen):
        checks = result[model]
        assert checks["differs_before"], f"gen rank {rank}: the engine already held the weights"
        for step in STEPS:
            assert all(ok for _, ok, _ in checks[f"session_{step}"]), checks[f"session_{step}"]
            assert checks[f"error_{step}"] is None, checks[f"error_{step}"]
            assert checks[f"mismatch_{step}"] == [], f"gen rank {rank} step {step}: {checks[f'mismatch_{step}']}"
            logits = checks[f"logits_{step}"]
            assert logits["rel_diff"] < LOGITS_TOLERANCE and logits["same_argmax"], f"step {step}: {logits}"
        assert checks["versions"] == [str(s) for s in STEPS]
    for rank, sent in enumerate(train):
        assert all(sent[model][s] > 0 for s in STEPS), f"megatron rank {rank} sent nothing"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ENGINES))
@pytest.mark.parametrize("model", list(MODELS))
def test_fast_path_everywhere_and_live_pieces_equal_metadata_layout(runs, layout: str, model: str) -> None:
    """Every tensor (DeepSeek's fused ``q_a_proj`` / ``kv_a_proj_with_mqa`` included) is written in
    place, and the traced map equals ``refit plan``'s metadata-only SGLang layout, rank by rank."""
    _, gen = runs(layout)
    for result in gen:
        assert result[model]["loader_path"] == []
        assert result[model]["live_equals_metadata_layout"]
