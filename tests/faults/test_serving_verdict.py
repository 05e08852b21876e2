"""The engine-agnostic serving verdict (``refit_core.kit``): a rank's state from its receiver's last
failure, and the one forward pre-hook that refuses for torn weights and for the engine's verdict, in-process
(the plugins' verdicts and the gloo exchange: ``tests/vllm/test_vllm_serving.py``,
``tests/sglang/test_sglang_serving.py``)."""

from __future__ import annotations

import pytest
import torch

from refit_core import PluginManager, RefitReceiver
from refit_core.contract.failures import StepFailure, UpdateMode
from refit_core.kit import (
    EngineRefusesError,
    RankState,
    Suspect,
    WorkerReport,
    engine_refusal,
    gather_reports,
    own_rank_state,
    refuse_engine,
    refuse_serving,
    resume_engine,
    resume_serving,
    serving_verdict,
    settle_serving,
)
from refit_core.kit.guard import TornWeightsError, torn_tensors

TORN = ("layer.weight",)


def _receiver(model: torch.nn.Module, rank: int = 1) -> RefitReceiver:
    """A receiver never set up (nothing connects): its version and last failure set by the test."""
    return RefitReceiver(model, rendezvous="127.0.0.1:1", rank=rank, world_size=2,
                         plugins=PluginManager(load_entry_points=False))


def _failed(receiver: RefitReceiver, *, torn: tuple[str, ...] = (), undecided: bool = False) -> RefitReceiver:
    receiver.last_failure = StepFailure(1, UpdateMode.STAGED, "test", torn, undecided)
    return receiver


def _landed(receiver: RefitReceiver, version: int) -> RefitReceiver:
    receiver.version, receiver.last_failure = version, None
    return receiver


def _suspect(receiver: RefitReceiver | None, model: torch.nn.Module, *, restores: bool = False) -> Suspect | None:
    return own_rank_state(receiver, model, rank=7, version=None, restores=restores).suspect


def test_a_rank_state_follows_its_receivers_failures_until_a_step_lands() -> None:
    model = torch.nn.Linear(2, 2)
    receiver = _receiver(model)
    assert own_rank_state(receiver, model, rank=7, version=None) == RankState(1, None, None)  # the receiver's rank
    assert _suspect(_failed(receiver, undecided=True), model) is Suspect.UNCONFIRMED
    assert _suspect(_failed(receiver), model) is Suspect.UNCONFIRMED  # a clean failure keeps what was suspect
    assert own_rank_state(None, model, rank=7, version=3) == RankState(7, 3, Suspect.UNCONFIRMED)  # no session
    assert _suspect(_landed(receiver, 4), model) is None
    assert _suspect(_failed(receiver, torn=TORN), model) is Suspect.TORN
    assert _suspect(_failed(receiver, torn=TORN, undecided=True), model) is Suspect.TORN  # torn is named first
    assert _suspect(_receiver(model), model) is Suspect.TORN  # a new session alone keeps it
    assert _suspect(_landed(receiver, 5), model) is None


def test_an_engine_that_restores_is_torn_only_where_it_refused_the_tensors() -> None:
    model = torch.nn.Linear(2, 2)
    receiver = _receiver(model)
    assert _suspect(_failed(receiver, torn=TORN), model, restores=True) is None  # every tensor put back
    assert _suspect(_failed(receiver, torn=TORN, undecided=True), model, restores=True) is Suspect.UNCONFIRMED
    _landed(receiver, 2)
    refuse_serving(model, TORN)  # what the engine's abort hook could not restore
    assert _suspect(_failed(receiver, torn=TORN), model, restores=True) is Suspect.TORN
    resume_serving(model)


def test_one_hook_refuses_with_the_engine_verdict_first_then_the_torn_weights() -> None:
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    refuse_serving(model, TORN)
    assert settle_serving(model, [RankState(0, 4), RankState(1, 3)], "a remedy") == (
        "engine refuses to serve: gen rank 0 holds version 4, gen rank 1 holds version 3 (the last step landed "
        "on some ranks only); refit again (a remedy)")
    assert len(model._forward_pre_hooks) == 1
    with pytest.raises(EngineRefusesError, match="gen rank 1 holds version 3"):
        model(x)
    resume_serving(model)  # a landed step's finish hook: the weights are whole, the ranks still disagree
    assert torn_tensors(model) == set() and engine_refusal(model) is not None
    with pytest.raises(EngineRefusesError):
        model(x)
    refuse_serving(model, TORN)
    assert settle_serving(model, [RankState(0, 4), RankState(1, 4)], "a remedy") is None
    assert engine_refusal(model) is None
    with pytest.raises(TornWeightsError, match="layer.weight"):
        model(x)
    refuse_engine(model, "engine refuses to serve: test")
    refuse_engine(model, "engine refuses to serve: replaced")
    with pytest.raises(EngineRefusesError, match="replaced"):
        model(x)
    resume_engine(model)
    resume_serving(model)
    assert not model._forward_pre_hooks and model(x).shape == (1, 2)


def test_the_verdict_names_needy_ranks_first_and_one_rank_exchanges_alone() -> None:
    assert serving_verdict([RankState(0, None), RankState(1, None)], "r") is None
    assert serving_verdict([RankState(0, 2), RankState(1, 2, Suspect.TORN)], "r") == (
        "engine refuses to serve: gen rank 1 holds version 2 and needs a refit (a failed step left weights "
        "partly written), gen rank 0 holds version 2; refit again (r)")
    mine = WorkerReport(RankState(3, 2, Suspect.UNCONFIRMED), failed=True)
    assert gather_reports(mine, None, 1) == [mine]  # no process group: no collective
