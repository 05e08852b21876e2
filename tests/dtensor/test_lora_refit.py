"""LoRA refits of a PEFT model sharded with FSDP2 (2 train ranks over gloo) into 1 gen rank, bit for bit.

Adapter mode: the source pieces are PEFT's adapter checkpoint, and the gen PEFT model's adapter equals
the train model's after each of two steps. Merged mode: the plain gen model equals PEFT's
``merge_and_unload()`` of the train model after each step (fp32, and bf16 weights, where PEFT merges
on CPU in fp32 and casts back). Bad input fails setup on every rank, naming what is wrong.
"""

import pytest
from lora_ranks import SUBSET, case_name, lora_ranks, peft_model

from tests.environments import require

from refit_core import PlanError, get_plugin_manager
from refit_core.kit.launch import free_port, spawn

require("peft")


CASES = [
    {"mode": "adapter", "dtype": "float32", "gen_dtype": "float32"},
    {"mode": "merged", "dtype": "float32", "gen_dtype": "float32"},
    {"mode": "merged", "dtype": "bfloat16", "gen_dtype": "bfloat16"},
    {"mode": "adapter", "dtype": "float32", "gen_dtype": "bfloat16", "cast": "strict"},  # refused at setup
    {"mode": "adapter", "dtype": "float32", "gen_dtype": "float32", "gen_targets": "q_proj,v_proj"},  # refused
    {"mode": "merged", "dtype": "float32", "gen_dtype": "float32", "colocated": "yes"},  # refused
]


@pytest.fixture(scope="module")
def ranks():
    """One spawn of 2 FSDP2 train ranks and 1 gen rank running every case (imports dominate the cost)."""
    ports = [free_port() for _ in range(2 + len(CASES))]
    results = spawn(lora_ranks, 3, 2, ports, CASES, timeout_s=240)
    return lambda index: [rank[case_name(CASES[index])] for rank in results]


def test_adapter_mode_moves_peft_adapter_checkpoint_bitwise(ranks):
    train0, train1, gen = ranks(0)
    for rank in (train0, train1):
        assert "error" not in rank, rank.get("error")
        assert rank["pieces_vs_peft"] == []
    for step in (1, 2):
        assert gen[f"version_{step}"] == step
        assert gen[f"checked_{step}"] == 2 * 7 * 2  # A and B of 7 modules in 2 layers
        assert gen[f"mismatch_{step}"] == [], f"step {step}"
    adapter_bytes = train0["bytes_1"] + train1["bytes_1"]
    assert 0 < adapter_bytes < 200_000  # the adapter only (the tiny model's weights are ~10x that)


@pytest.mark.parametrize("index", [1, 2], ids=["float32", "bfloat16"])
def test_merged_mode_equals_merge_and_unload_bitwise(ranks, index):
    train0, train1, gen = ranks(index)
    assert "error" not in train0, train0.get("error")
    for step in (1, 2):
        assert gen[f"version_{step}"] == step
        assert gen[f"checked_{step}"] > 0
        assert gen[f"mismatch_{step}"] == [], f"step {step}"
    assert train0["bytes_1"] + train1["bytes_1"] > 10 * 65536  # the whole model moves
    # a subset step's sub-schedule merges too: the two named weights move merged, the others keep step 2's
    assert gen["version_subset"] == 3 and gen["mismatch_subset"] == []
    assert gen["subset_changes"] == list(SUBSET)  # step 3's adapters change both (the check can fail)
    assert train0["bytes_subset"] + train1["bytes_subset"] < train0["bytes_1"] + train1["bytes_1"]


def test_adapter_dtype_mismatch_fails_setup_on_every_rank_naming_the_module(ranks):
    """Adapters follow ``RefitOptions.cast`` as weights do: cast on the way by default (as vLLM's own
    adapter loader casts to its ``lora_dtype``), refused under ``cast="strict"``, naming every tensor."""
    for rank in ranks(3):
        assert "PlanError" in rank.get("error", ""), rank
        assert "lora_A.weight" in rank["error"] and "self_attn" in rank["error"]


def test_adapter_targets_the_engine_lacks_fail_setup_on_every_rank_naming_the_module(ranks):
    for rank in ranks(4):  # the trainer adapts k_proj, o_proj, ...: the engine has no slot for them
        assert "PlanError" in rank.get("error", ""), rank
        assert "self_attn.k_proj.lora_A.weight" in rank["error"]


def test_merged_mode_refuses_colocated_pairs_on_every_rank(ranks):
    for rank in ranks(5):  # a colocated engine reads the trainer's memory in place: nothing would merge
        assert "PlanError" in rank.get("error", ""), rank
        assert "merged-mode LoRA needs network pairs" in rank["error"] and "_proj" in rank["error"]


@pytest.mark.parametrize("setting,word", [({"use_dora": True}, "DoRA"), ({"use_rslora": True}, "rsLoRA"),
                                         ({"modules_to_save": ["lm_head"]}, "modules_to_save")])
def test_unsupported_peft_settings_are_refused_naming_them(setting, word):
    model = peft_model(3, **setting)
    with pytest.raises(PlanError, match=word):
        get_plugin_manager().source_pieces(model)
