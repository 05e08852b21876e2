"""Whether a vLLM engine may serve (``refit_vllm.serving``), without an engine: the verdict over the
ranks' states, the refusing forward pre-hook, and the state exchange between workers over gloo
(what every worker runs after each step; a real engine refusing is ``test_vllm_engine.py``'s abort
scenario)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("refit_vllm")

from refit_vllm.serving import EngineRefusesError, RankState, Suspect, refusal, refuse, refused, resume
from serving_ranks import gather_rank

from refit_core.kit import TornWeightsError, refuse_serving, resume_serving
from refit_core.kit.launch import free_port, spawn

AGAIN = "; refit again (init_weight_transfer_engine / refit_init, then a step that lands on every rank)"


def test_an_engine_serves_only_with_one_version_and_no_rank_needing_a_refit() -> None:
    assert refusal([RankState(0, 4), RankState(1, 4)]) is None
    assert refusal([RankState(0, None), RankState(1, None)]) is None
    assert refusal([RankState(0, 4), RankState(1, 3)]) == (
        "engine refuses to serve: gen rank 0 holds version 4, gen rank 1 holds version 3 "
        "(the last step landed on some ranks only)" + AGAIN)
    assert refusal([RankState(0, 4), RankState(1, 3, Suspect.UNCONFIRMED)]) == (
        "engine refuses to serve: gen rank 1 holds version 3 and needs a refit (a staged commit could not be "
        "confirmed), gen rank 0 holds version 4" + AGAIN)
    assert refusal([RankState(0, None, Suspect.TORN)]) == (
        "engine refuses to serve: gen rank 0 holds the engine's initial weights and needs a refit (a failed "
        "step left weights partly written)" + AGAIN)
    many = refusal([RankState(r, r) for r in range(10)])
    assert many is not None and "gen rank 7 holds version 7 (and 2 more)" in many and "rank 8" not in many


def test_a_refused_model_raises_the_engine_verdict_first_until_it_resumes() -> None:
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    refuse_serving(model, ["weight"])  # the plugin's own torn-tensor guard, installed first
    refuse(model, "engine refuses to serve: test")
    assert refused(model) == "engine refuses to serve: test"
    with pytest.raises(EngineRefusesError, match="engine refuses to serve: test"):
        model(x)
    resume(model)
    assert refused(model) is None
    with pytest.raises(TornWeightsError):
        model(x)
    resume_serving(model)
    assert model(x).shape == (1, 2)


def test_workers_exchange_their_states_over_gloo() -> None:
    states = [(0, 4, 0), (1, 3, int(Suspect.UNCONFIRMED))]
    results = spawn(gather_rank, 2, free_port(), states, timeout_s=120)
    expected = [[0, 4, None], [1, 3, "UNCONFIRMED"]]
    assert [[list(row) for row in r] for r in results] == [expected, expected]
