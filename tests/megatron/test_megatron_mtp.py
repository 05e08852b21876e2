"""DeepSeek-V3 with one MTP layer: a real megatron-core ``GPTModel`` with ``mtp_num_layers=1`` (2 gloo
ranks, local spec) refit into the kit's reference engine, TP 2, PP 2 (the MTP layer on the last
stage), PP 2 split unevenly (1 + 3 layers, then MTP) and EP 2 (its experts split too), two steps
bit for bit against megatron's own ``sharded_state_dict()`` converted by the test's routine
(``megatron_ranks.to_hf``, ``engine_ranks.py``).
transformers' DeepSeek-V3 drops MTP weights, so the FSDP2 destination of ``test_megatron_refit.py``
cannot hold them; the reference engine holds every tensor of the checkpoint.
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("refit_megatron")

from engine_ranks import ENGINE_MODELS, assert_two_refits_landed

ENGINE_MODEL = "mla-mtp"
"""The model this module refits into the reference engine (``tests/megatron/conftest.py``: one spawn for
every such module)."""
LAYOUTS = ["tp2", "pp2", "ep2", "pp2-uneven"]
MTP_LAYER = f"model.layers.{ENGINE_MODELS['mla-mtp'].config['num_hidden_layers']}."


@pytest.fixture(scope="module")
def results(engine_results):
    return engine_results(ENGINE_MODEL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_refits_with_the_mtp_layer_land_bitwise(results, layout):
    train, gen = results
    assert_two_refits_landed(gen, layout)
    sent = {n for r in train for n in r[layout]["names"] if n.startswith(MTP_LAYER)}
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_b_proj", "mlp.experts.3.up_proj",
                 "mlp.shared_experts.down_proj", "mlp.gate.e_score_correction_bias"):
        assert any(n.startswith(MTP_LAYER + part) for n in sent), part


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pieces_are_views_of_parameters_and_metadata_layout_matches(results, layout):
    train, _ = results
    for rank, result in enumerate(train):
        assert result[layout]["views_share_parameter_memory"], f"train rank {rank}"
        assert result[layout]["metadata_layout_equal"], f"train rank {rank}: refit plan layout differs"
        assert result[layout]["plan_equals_refit_plan"], f"train rank {rank}: live fingerprint != refit plan's"
