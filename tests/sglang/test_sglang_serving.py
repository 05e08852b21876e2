"""The SGLang worker's serving verdict after a step (``refit_sglang.serving``), without SGLang: the
worker's custom loader on a plain module, with its TP peers' states handed in by the exchange (what
SGLang's TP group carries in an engine). Runs in either virtualenv."""

from __future__ import annotations

import pytest

from tests.environments import require
import torch

require("refit_sglang")

from refit_sglang import worker
from refit_sglang.serving import EngineRefusesError, RankState, Suspect, refusal, refused

BAD_TICKET = [("not a refit ticket", torch.empty(0))]


def test_a_worker_refuses_while_a_tp_peer_needs_a_refit_and_serves_once_all_agree() -> None:
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    peer = RankState(1, 3, Suspect.UNCONFIRMED)
    worker.receive(model, BAD_TICKET, tp_rank=lambda: 0, exchange=lambda mine: [mine, peer])
    message = refused(model)
    assert message == ("engine refuses to serve: gen rank 1 holds version 3 and needs a refit (a staged commit "
                       "could not be confirmed), gen rank 0 holds the engine's initial weights; refit again "
                       "(a step that lands on every TP worker)")
    assert worker.last_error(model).startswith(message + ". This worker's step failed: ")
    assert worker.rank_state(model) == RankState(0, None, None)
    with pytest.raises(EngineRefusesError, match="gen rank 1 holds version 3"):
        model(x)
    worker.receive(model, BAD_TICKET, tp_rank=lambda: 0, exchange=lambda mine: [mine, RankState(1, None)])
    assert refused(model) is None
    assert model(x).shape == (1, 2)


def test_a_worker_that_cannot_hear_its_peers_refuses() -> None:
    model = torch.nn.Linear(2, 2)

    def lost(mine: RankState) -> list[RankState]:
        raise RuntimeError("gloo: connection to a TP peer closed")

    worker.receive(model, BAD_TICKET, tp_rank=lambda: 1, exchange=lost)
    assert refused(model) is not None and refused(model).startswith(
        "engine refuses to serve: gen rank 1 could not learn its TP peers' weight versions (RuntimeError: gloo")
    with pytest.raises(EngineRefusesError):
        model(torch.ones(1, 2))


def test_versions_that_differ_refuse_without_a_suspect() -> None:
    assert refusal([RankState(0, 4), RankState(1, 4)]) is None
    assert refusal([RankState(1, 3), RankState(0, 4)]) == (
        "engine refuses to serve: gen rank 0 holds version 4, gen rank 1 holds version 3 (the last step landed "
        "on some ranks only); refit again (a step that lands on every TP worker)")
