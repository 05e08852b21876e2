"""Whether a vLLM engine may serve (``refit_vllm.serving``), without an engine: the verdict over the
ranks' states, the refusing forward pre-hook, and the state exchange between workers over gloo
(what every worker runs after each step; a real engine refusing is ``test_vllm_engine.py``'s abort
scenario)."""

from __future__ import annotations

import pytest

from tests.environments import require
import torch

require("refit_vllm")

from refit_vllm.serving import EngineRefusesError, RankState, StepOutcome, Suspect, refusal, refuse, refused, resume
from serving_ranks import gather_rank

from refit_core import RefitError
from refit_core.kit import refuse_serving, resume_serving
from refit_core.kit.guard import TornWeightsError
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
    expected = [[0, 4, None, False], [1, 3, "UNCONFIRMED", True]]
    assert [[list(row) for row in r] for r in results] == [expected, expected]


def test_one_error_per_step_names_the_verdict_and_the_failed_ranks() -> None:
    own = RuntimeError("gloo: peer closed")
    refused = StepOutcome("engine refuses to serve: gen rank 1 holds version 3", (1,), reports=True).error(own)
    assert isinstance(refused, EngineRefusesError) and str(refused) == (
        "engine refuses to serve: gen rank 1 holds version 3; the step failed on gen rank(s) [1]. "
        "This worker's step failed: gloo: peer closed")
    assert StepOutcome(None, (0, 1), reports=True).error(own) is own  # the engine serves: the step's own error
    assert StepOutcome(None, (), reports=True).error(None) is None
    others = StepOutcome(None, (0,), reports=True).error(None)
    assert type(others) is RefitError and str(others).startswith("refit step failed on gen rank(s) [0]")
