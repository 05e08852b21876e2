"""refit into a real vLLM engine (CPU, fp32, greedy), trained side FSDP2 over 2 ranks (dtensor plugin).

Every scenario runs in its own process (``scenarios.py``), forked from a server that imported vLLM once
(``scenario_server.py``): one vLLM engine each (the mismatched setup and the subset session are one
scenario: their tests share its engine). The check is the
user's: after every refit, vLLM's greedy tokens equal HF transformers' with the same weights, token
for token, and the weight version advances where vLLM shows it (engine, request outputs, workers).
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from scenario_server import ScenarioServer

from tests.environments import require

require("vllm")
require("refit_dtensor")
require("refit_vllm")

pytestmark = pytest.mark.vllm

SERVER = ScenarioServer(Path(__file__).with_name("scenarios.py"))
atexit.register(SERVER.close)


def run_scenario(name: str, timeout: float = 600, **kwargs: Any) -> dict[str, Any]:
    """Run one scenario in a process of its own (forked by the scenario server, which imported vLLM once);
    whatever it leaves behind (engine, workers, trainers) is killed."""
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        finished = SERVER.run(name, kwargs, timeout, out, err)
    stdout, stderr = finished.stdout, finished.stderr
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (f"scenario {name} {kwargs} printed no result (exit {finished.exit}):\n"
                   f"{stdout[-3000:]}\n{stderr[-8000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert "scenario_error" not in result, result["scenario_error"]
    return result


def check_refits(result: dict[str, Any], tp: int, steps: tuple[int, ...] = (1, 2)) -> None:
    assert result["trainer_error"] is None, result["trainer_error"]
    assert result["initial_equal"], "the engine did not match HF even before refit"
    assert [s["step"] for s in result["steps"]] == list(steps)
    for step in result["steps"]:
        k = step["step"]
        assert step["equal"], f"step {k}: vLLM generated {step['got']}, HF transformers {step['want']}"
        assert step["received_versions"] == [k] * tp
        assert step["engine_version"] == str(k)
        assert step["worker_versions"] == [k] * tp
        assert step["output_versions"] == [str(k)]
    assert all(result["layout_equal"]), "live destination map differs from the metadata-only layout"
    assert all(result["replanned_equal"]), "after refit steps, a new session plans another destination map"


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-qwen2"])
def test_fsdp2_to_vllm_tp1(model: str) -> None:
    """TP 1, refit's weight-transfer route, fast path only: Mixtral (its own expert naming) and Qwen2 (q/k/v
    biases). The other families at TP 1, each in an engine of its own elsewhere in this suite: Llama bitwise
    against vLLM's own reload (``test_vllm_docs.py``) and token for token (``test_refit_demo_dtensor_to_vllm``);
    Qwen3 with every check here (``test_worker_extension_tied_padded_embeddings``: its tied variant, through
    the worker extension); Qwen3-MoE with every check here (``test_loader_path``), its fast path for the two
    groups that test sends through the loader at TP 2 (``test_fsdp2_to_vllm_tp2``)."""
    result = run_scenario("refit", model=model, tp=1)
    check_refits(result, tp=1)
    plan = result["plan"][0]
    assert plan["loader"] == [] and plan["mode"] == "reload", plan
    assert result["load_weights_calls_during_steps"] == [0], "the fast path called load_weights"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-llama-mqa"])
def test_fsdp2_to_vllm_tp2(model: str) -> None:
    """TP 2 (two CPU workers): the Llama and the Qwen3 families (Qwen3's attention, its MoE experts).
    ``tiny-llama-mqa`` has one KV head, replicated on both ranks, and a vocabulary of 500 that vLLM pads
    to 512 (256 rows per rank, the last 12 padding). On it, a third step then lands on worker 0 only
    (worker 1's loader fails): the engine must refuse on both."""
    torn = {"torn_rank": 1} if model == "tiny-llama-mqa" else {}
    result = run_scenario("refit", model=model, tp=2, **torn)
    check_refits(result, tp=2)
    assert all(p["loader"] == [] for p in result["plan"])
    assert result["load_weights_calls_during_steps"] == [0, 0]
    if torn:
        check_split_engine_refuses(result["split"])


def check_split_engine_refuses(split: dict[str, Any]) -> None:
    verdict = ("engine refuses to serve: gen rank 1 holds version 2 and needs a refit (a failed step left weights "
               "partly written), gen rank 0 holds version 3; refit again")
    error = split["step_error"]  # one error from the last worker: vLLM's RPC replies stay in step
    assert error is not None and verdict in error and "the step failed on gen rank(s) [1]" in error, error
    assert "vLLM's loader refused the weights" in error, error
    assert split["states"] == [[0, 3, 0], [1, 2, 1]]  # (gen rank, version, suspect: 1 torn)
    assert len(split["refusals"]) == 2 and all(r.startswith(verdict) for r in split["refusals"]), split
    assert split["check_serving_error"] is not None and verdict in split["check_serving_error"]
    assert split["generate_error"] is not None, "an engine on two versions generated"
    if split["alive_after_refusal"]:  # vLLM 0.32's multiprocess engine core stops at the refused forward
        assert split["recovery_trainer_error"] is None and split["states_after_recovery"] == [[0, 4, 0], [1, 4, 0]]
        assert split["recovered_equal_hf"]


@pytest.fixture(scope="module")
def abort_then_loader() -> dict[str, Any]:
    """One tiny-qwen3-moe engine for the two tests that take it (an engine start is much of their time):
    the failed and torn steps first, which leave it serving version 2, then the loader path's steps 3, 4."""
    return run_scenario("abort_then_loader", model="tiny-qwen3-moe",
                        loader=[r"layers\.1\.self_attn\.q_proj", r"layers\.0\.mlp\.experts\."])


def part(result: dict[str, Any], name: str) -> dict[str, Any]:
    """One test's part of a scenario that several tests share, which must have run to its end."""
    assert "scenario_error" not in result[name], result[name]["scenario_error"]
    return result[name]


def test_loader_path(abort_then_loader: dict[str, Any]) -> None:
    """Layer 1's q_proj and layer 0's experts forced off the fast path: whole fused groups follow (steps 3
    and 4, into the engine the failure test left on version 2)."""
    result = part(abort_then_loader, "loader")
    check_refits(result, tp=1, steps=(3, 4))
    plan = result["plan"][0]
    assert sorted(plan["loader"]) == [
        "model.layers.0.mlp.experts.down_proj.weight", "model.layers.0.mlp.experts.gate_proj.weight",
        "model.layers.0.mlp.experts.up_proj.weight", "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
    assert plan["loader_modules"] == ["model.layers.0.mlp.experts.routed_experts",
                                      "model.layers.1.self_attn.qkv_proj"]
    assert result["load_weights_calls_during_steps"] == [2], "one load_weights call per step"


def test_worker_extension_tied_padded_embeddings() -> None:
    """``collective_rpc`` users (RefitWorkerExtension); tied embeddings, vocabulary 500 padded to 512."""
    result = run_scenario("refit", model="tiny-qwen3-tied-v500", tp=1, route="extension")
    check_refits(result, tp=1)
    assert result["ranks"] == [0]


@pytest.fixture(scope="module")
def mismatch_then_subset() -> dict[str, Any]:
    """One tiny-qwen3 engine for both tests below (an engine start is most of their time): a mismatched
    trainer's setup first, then the subset session on the weights it left."""
    return run_scenario("mismatch_then_subset", engine_model="tiny-qwen3", train_model="tiny-llama")


def test_mismatched_model_fails_at_setup_and_engine_keeps_serving(mismatch_then_subset: dict[str, Any]) -> None:
    result = mismatch_then_subset["mismatch"]
    error = result["engine_error"]
    assert error is not None and "PlanError" in error and "have no source" in error
    assert "model.layers.0.self_attn.q_norm.weight" in error
    assert result["trainer_error"] is not None and "q_norm" in result["trainer_error"]
    assert result["still_generates"] and result["matches_hf_initial"]


def test_failed_step_keeps_previous_weights_and_a_torn_engine_refuses_to_serve(
        abort_then_loader: dict[str, Any]) -> None:
    """A step whose nccl-style update info gives a tensor the wrong shape is refused before any byte
    lands, naming it; the trainers stop at once. Trainers die after setup: update_weights fails, vLLM's
    reload is rolled back, old weights serve. Then vLLM's loader fails on the loader path (the plugin
    cannot tell how far it got: those tensors count as torn): every rank reports it needs a refit,
    generation raises a named refusal, also in a new session before its first step; the new session's
    step (its update info naming every tensor, as vLLM's nccl backend's) lifts it and the engine equals HF."""
    result = part(abort_then_loader, "abort")
    assert result["names_error"] == ("InvalidRequestError: update_info gives the wrong full shape for 1 tensor(s): "
                                     "model.norm.weight [129] (the engine's is [128])"), result["names_error"]
    # the trainers hear it as a failed step, long before their 30 s deadline (1.2 s measured)
    assert result["names_trainer_error"] is not None and result["names_trainer_s"] < 15, result["names_trainer_s"]
    assert result["names_same_tokens_after"]
    error = result["step_error"]  # a StepFailedError (a TransferError) that names nothing torn
    assert error is not None and "StepFailedError" in error and "the engine's weights are unchanged" in error, error
    assert result["same_tokens_after"]
    assert result["engine_version"] == "default"
    assert result["states_after_clean_failure"] == [[0, None, 0]]  # (rank, version, suspect)

    refusal = ("engine refuses to serve: gen rank 0 holds the engine's initial weights and needs a refit (a failed "
               "step left weights partly written); refit again")
    error = result["torn_step_error"]
    assert error is not None and "EngineRefusesError" in error and refusal in error, error
    assert "vLLM's loader refused the weights" in error, error  # the rank's own failure, named
    assert "keeps the weights it held before this session" in error and "version None" not in error, error
    assert result["states_after_torn_step"] == [[0, None, 1]]
    assert result["refusals"][0] is not None and result["refusals"][0].startswith(refusal), result["refusals"]
    assert result["generate_error"] is not None and refusal in result["generate_error"], result["generate_error"]
    assert result["states_in_new_session"] == [[0, None, 1]]
    assert result["still_refuses_in_new_session"], "a new session lifted the refusal before any step landed"

    assert result["recovery_trainer_error"] is None, result["recovery_trainer_error"]
    assert result["states_after_recovery"] == [[0, 2, 0]]
    assert result["recovered_equal_hf"], "after the recovery step vLLM does not generate HF's tokens"
    assert result["version_after_recovery"] == "2"


def test_subset_step_changes_exactly_the_named_tensors_then_a_whole_step_lands(
        mismatch_then_subset: dict[str, Any]) -> None:
    """vLLM's nccl-style update info naming a subset (two fused groups, two norms): the norms it names
    hold step 1's bytes, the others step 0's, and vLLM generates HF's tokens with exactly that mix;
    then a whole step lands everything (in the engine a mismatched trainer's failed setup left)."""
    result = mismatch_then_subset["subset"]
    assert result["trainer_error"] is None, result["trainer_error"]
    assert result["read_after_subset"] == {
        "model.norm.weight": 1, "model.layers.0.input_layernorm.weight": 1,  # named: the new bytes
        "model.layers.1.input_layernorm.weight": 0, "model.layers.0.post_attention_layernorm.weight": 0,
        "model.layers.0.self_attn.q_norm.weight": 0}, result["read_after_subset"]  # not named: untouched
    assert result["subset_tokens_differ_from_step_0"] and result["subset_tokens_equal_hf"]
    assert result["version_after_subset"] == "1"
    assert set(result["read_after_whole"].values()) == {2}, result["read_after_whole"]
    assert result["whole_tokens_equal_hf"] and result["version_after_whole"] == "2"


def test_inflight_refit_asyncllm() -> None:
    """AsyncLLM: pause(keep) -> refit driven by the trainer-side API -> resume; the request finishes."""
    result = run_scenario("inflight", model="tiny-qwen3")
    assert result["trainer_error"] is None, result["trainer_error"]
    assert result["unfinished_at_pause"]
    assert result["client_calls"] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                      "finish_weight_update"]
    assert result["engine_version_after_refit"] == "1"
    assert result["completed_tokens"] == 48
    (v0, s0, e0), (v1, s1, e1) = result["spans"]
    assert (v0, s0) == ("0", 0) and (v1, e1) == ("1", 48) and e0 == s1 >= result["tokens_at_pause"]
    assert result["after_equal_hf"], "requests after the refit do not match HF with the new weights"


@pytest.mark.slow
def test_refit_demo_dtensor_to_vllm() -> None:
    """The README's main job: ``refit demo --train dtensor --gen vllm``."""
    proc = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "dtensor", "--gen", "vllm"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].endswith("verified OK"), lines[-1]
    assert "dtensor(fsdp=2) -> vllm(single)" in proc.stdout, proc.stdout  # both sides' default layouts
    assert "greedy generation equals HF transformers' token for token" in proc.stdout
    assert [line.split()[:3] for line in lines if line.lstrip().startswith("step")] == [
        ["step", "0", "gen:"], ["step", "1", "gen:"]]
    assert "INFO" not in proc.stdout and "Traceback" not in proc.stdout, "engine logs reached the console"
