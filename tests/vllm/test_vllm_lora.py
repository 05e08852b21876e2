"""Adapter mode into a real vLLM engine (CPU, fp32, LoRA enabled): a PEFT adapter's tensors land in the
engine's LoRA slots (``refit_vllm.lora``), checked against HF transformers running the PEFT model and
against vLLM's own adapter loader, and the bad inputs refused at setup on both sides."""

from __future__ import annotations

import pytest

from tests.environments import require

require("vllm")
require("peft")
require("refit_vllm")

from test_vllm_engine import run_scenario

from refit_core import LoraMode, LoraSpec, OptionError

pytestmark = pytest.mark.vllm


TP = 2


def adapter_numel(cfg: dict, rank: int, tp: int) -> int:
    """Elements of a rank-``rank`` adapter on every linear module of a Llama decoder, as one of ``tp`` ranks
    holds them (A ``[r, in]``, B ``[out, r]``): column-parallel q/k/v/gate/up slice B, row-parallel o/down A."""
    hidden, inter, head = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    column = [(hidden, q), (hidden, kv), (hidden, kv), (hidden, inter), (hidden, inter)]
    row = [(q, hidden), (inter, hidden)]
    return cfg["num_hidden_layers"] * (sum(rank * (i + o // tp) for i, o in column)
                                       + sum(rank * (i // tp + o) for i, o in row))


@pytest.mark.slow
def test_adapter_refits_into_lora_slots_match_hf_peft_and_vllms_loader() -> None:
    """Two refits of a rank-8 adapter (alpha 20: vLLM folds 2.5 into B) into a TP-2 engine: greedy tokens
    equal HF + PEFT's, each worker's slots equal byte for byte what vLLM's ``add_lora`` of the same adapter
    puts in the second slot, the version shows in the outputs; the adapter registered once (no reload);
    then a rank above ``max_lora_rank``, a module the engine does not have, a dtype under
    ``cast="strict"`` and more adapters than slots are refused at setup on every worker and the trainer,
    naming what is wrong, and the adapter keeps serving; a failed step's restore puts every slot byte back."""
    from refit_core.kit.models import PRESETS

    result = run_scenario("lora", model="tiny-llama", tp=TP)
    assert result["trainer_error"] is None, result["trainer_error"]
    numel = adapter_numel(PRESETS["tiny-llama"], 8, TP)
    for k, step in enumerate(result["steps"], start=1):
        assert step["equal"], f"step {k}: vLLM generated {step['got']}, HF + PEFT {step['want']}"
        assert step["differs_from_base"], "the adapter changed no token: the check could not fail"
        assert step["received_versions"] == [k] * TP and step["output_versions"] == [str(k)]
        assert step["adapter_versions"] == [{"policy": k}] * TP
        for worker, slots in enumerate(step["slots"]):
            assert slots["differ"] == [], f"step {k}, worker {worker}: slots differ from vLLM's own loader"
            assert slots["slots"] == {"policy": 0, "reference": 1} and slots["nonzero"] == numel, slots
        assert [s["bytes"] for s in step["stats"]] == [4 * numel] * TP  # fp32 adapter bytes, nothing else
    assert result["steps"][0]["got"] != result["steps"][1]["got"]
    assert result["base_unchanged"], "requests without the adapter no longer match the base model"
    assert result["adapter_loads"] == [2] * TP, "vLLM's adapter loader ran for refit's adapter"

    rank = "refit adapter 'wide': rank r=16 exceeds the engine's max_lora_rank=8"
    target = "refit adapter 'alien': target module(s) ['w_pack'] are not LoRA layers of this vLLM engine"
    dtype = ("dtype mismatch in 28 tensor(s) under cast policy 'strict': model.layers.0.mlp.down_proj.lora_A.weight: "
             "source torch.bfloat16 vs destination torch.float32")
    for case, message in (("rank", rank), ("targets", target), ("dtype", dtype)):
        refused = result[case]
        assert len(refused["engine"]) == TP, refused  # every worker refuses
        assert all(e is not None and "PlanError" in e and message in e for e in refused["engine"]), refused
        assert refused["trainer"] is not None and message in refused["trainer"], refused
        assert refused["seconds"] < 15, refused  # long before the 30 s deadline (0.4 s measured)
    assert result["after_refusals_equal"], "a refused session changed the adapter"
    assert result["layout_equal"] == [True] * TP, "the live adapter map differs from the metadata-only layout"
    assert all(a["torn"] and a["restored"] for a in result["abort"]), result["abort"]
    assert result["after_abort_equal"], "after a failed step's restore the adapter serves other tokens"
    assert result["second"] == [None] * TP
    assert result["third"] == ["PlanError: refit adapter 'third': the engine's 2 LoRA slot(s) (max_loras) already "
                               "hold refit adapters ['policy', 'second']; start vLLM with max_loras >= 3"] * TP


def test_the_engine_takes_adapter_mode_specs_only() -> None:
    from refit_vllm.lora import lora_int_id, lora_spec

    assert lora_spec("r=8,alpha=16,targets=q,v,name=p") == LoraSpec(8, 16.0, ("q_proj", "v_proj"), "p")
    assert lora_spec({"rank": 4, "alpha": 8, "targets": ["o"]}).targets == ("o_proj",)
    with pytest.raises(OptionError, match="adapter mode only; in merged mode it serves plain weights"):
        lora_spec(LoraSpec(8, 16.0, mode=LoraMode.MERGED))
    assert lora_int_id("policy") == lora_int_id("policy") > 0 and lora_int_id("policy") != lora_int_id("policy2")


def test_the_trainers_init_info_carries_the_adapter_to_the_workers() -> None:
    from refit_vllm.transfer import RefitTrainerInitInfo, RefitWeightTransferInitInfo

    info = RefitTrainerInitInfo(rank=0, rendezvous="127.0.0.1:1", lora="r=8,targets=q,v,name=policy").worker_info()
    assert info.lora == "r=8,targets=q,v,name=policy" and RefitWeightTransferInitInfo(rendezvous="h:1").lora is None


def test_metadata_only_adapter_layout_replicates_kv_heads_and_refuses_what_adapter_mode_does_not_write() -> None:
    """``refit plan``'s view of vLLM's LoRA slots (checked against a live engine above): one KV head over
    TP 2 is whole on both ranks; row-parallel A is split by columns."""
    from refit_vllm.lora_layout import adapter_destination_layout

    from refit_core import ParallelLayout, PlanError
    from refit_core.kit.models import PRESETS

    mqa = dict(PRESETS["tiny-llama"], num_key_value_heads=1)
    spec = LoraSpec(rank=4, alpha=8, targets=("k_proj", "o_proj"))
    boxes = [{p.spec.name: (p.box.offsets, p.box.sizes) for p in
              adapter_destination_layout(mqa, spec, ParallelLayout(tp=2), rank).pieces} for rank in (0, 1)]
    k_b, o_a = "model.layers.1.self_attn.k_proj.lora_B.weight", "model.layers.1.self_attn.o_proj.lora_A.weight"
    assert boxes[0][k_b] == boxes[1][k_b] == ((0, 0), (32, 4))
    assert (boxes[0][o_a], boxes[1][o_a]) == (((0, 0), (4, 64)), ((0, 64), (4, 64)))
    with pytest.raises(PlanError, match="adapter mode lays out tp and dp only; got {'pp': 2}"):
        adapter_destination_layout(mqa, spec, ParallelLayout(tp=1, pp=2), 0)
    moe = dict(PRESETS["tiny-qwen3-moe"])
    with pytest.raises(PlanError, match="target down_proj is held by MoE experts"):
        adapter_destination_layout(moe, LoraSpec(rank=4, alpha=8, targets=("q_proj", "down_proj")),
                                   ParallelLayout(tp=1), 0)


def test_refit_plan_for_vllm_in_adapter_mode_plans_its_lora_slots(capsys) -> None:
    """``refit plan --gen vllm --lora`` plans vLLM's slot boxes (:mod:`refit_vllm.lora_layout`), metadata only:
    its bytes are those boxes', and what vLLM's slots cannot hold (MoE MLPs) is refused by the plan."""
    from refit_vllm.lora_layout import adapter_destination_layout

    from refit_core import ParallelLayout, PlanError, get_plugin_manager
    from refit_core.kit.models import PRESETS
    from refit_core.plan.offline import plan_from_metadata
    from refit_core.tools.cli import main

    mqa = dict(PRESETS["tiny-llama"], num_key_value_heads=1)
    spec = LoraSpec.parse("r=4,targets=q,k,v,o,gate,up,down")
    slots = sum(p.box.numel * 4 for r in (0, 1)
                for p in adapter_destination_layout(mqa, spec, ParallelLayout(tp=2), r).pieces)
    plan = plan_from_metadata(get_plugin_manager(), mqa, "dtensor", ParallelLayout(fsdp=2), "vllm",
                              ParallelLayout(tp=2), lora=spec)
    kv_whole = 2 * 2 * 4 * 32 // 2  # per rank: k / v B of 2 layers hold the one KV head whole, not half of it
    assert plan.schedule.summary.bytes == slots == 2 * 4 * (adapter_numel(mqa, 4, 2) + kv_whole)
    with pytest.raises(PlanError, match="target down_proj is held by MoE experts"):
        plan_from_metadata(get_plugin_manager(), dict(PRESETS["tiny-qwen3-moe"]), "dtensor", ParallelLayout(fsdp=2),
                           "vllm", ParallelLayout(tp=1), lora=LoraSpec.parse("r=4,targets=q,down"))
    assert main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "vllm:tp=2",
                 "--lora", "r=8,targets=q,v", "--device", "cpu"]) == 0
    assert "lora:         adapter mode, r=8, targets q_proj,v_proj" in capsys.readouterr().out


def test_the_loops_engine_actor_takes_an_adapter_and_picks_a_slot_rank_vllm_accepts() -> None:
    from refit_vllm.ray import VLLMEngineActor, lora_slot_rank

    from refit_core import PlanError

    assert VLLMEngineActor.supports_lora
    assert (lora_slot_rank(1), lora_slot_rank(8), lora_slot_rank(9), lora_slot_rank(500)) == (1, 8, 16, 512)
    with pytest.raises(PlanError, match="r=600 exceeds vLLM's largest max_lora_rank 512"):
        lora_slot_rank(600)
