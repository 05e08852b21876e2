"""Tied embeddings with PP 2 (and TP 2 x PP 1 for contrast): a real megatron-core ``GPTModel`` (Qwen3,
``share_embeddings_and_output_weights``, 2 gloo ranks) refit into the kit's reference engine, two steps
bit for bit. Under PP 2 the last stage holds a synchronized copy of the embedding as its output layer;
only the first stage sends ``embed_tokens`` and no ``lm_head`` travels (the checkpoint has none).
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("refit_megatron")

from engine_ranks import assert_two_refits_landed

ENGINE_MODEL = "dense-tied"
"""The model this module refits into the reference engine (``tests/megatron/conftest.py``: one spawn for
every such module)."""
LAYOUTS = ["pp2", "tp2"]


@pytest.fixture(scope="module")
def results(engine_results):
    return engine_results(ENGINE_MODEL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_refits_of_a_tied_model_land_bitwise(results, layout):
    train, gen = results
    assert_two_refits_landed(gen, layout)
    for rank, result in enumerate(train):
        assert result[layout]["views_share_parameter_memory"], f"train rank {rank}"
        assert result[layout]["metadata_layout_equal"], f"train rank {rank}: refit plan layout differs"
        assert result[layout]["plan_equals_refit_plan"], f"train rank {rank}: live fingerprint != refit plan's"
        assert "lm_head.weight" not in result[layout]["names"]
    if layout == "pp2":
        assert "model.embed_tokens.weight" in train[0][layout]["names"]
        assert "model.embed_tokens.weight" not in train[1][layout]["names"], "the last stage's copy travels"
