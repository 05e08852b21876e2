"""Rank programs for the commit-point tests: a toy refit of two steps in which a rank misbehaves around the
step's commit point (an engine rank descheduled right after its vote, a trainer that exits right after
``send()`` or dies right after deciding, weights replaced after setup)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from enum import StrEnum

import torch
from fault_ranks import _state
from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.endpoints import commit

VERSIONS = (100, 101)  # the two steps' weight versions (reference weights of step 0 and step 1)


class Trick(StrEnum):
    """What one rank does wrong in the second step."""

    NONE = "none"
    PAUSE_AFTER_VOTE = "pause_after_vote"
    """A gen rank sleeps 2 s between its vote and reading the decision (a descheduled process)."""
    EXIT_AFTER_SEND = "exit_after_send"
    """Train rank 0 exits (``os._exit``, no ``close()``) as soon as ``send()`` returns."""
    DIE_AFTER_DECIDING = "die_after_deciding"
    """Train rank 0 is killed (SIGKILL) half a second after it published its decision."""
    READ_DECISION_LATE = "read_decision_late"
    """Train rank 1 sleeps 2 s before it reads the decision (a descheduled process), while train rank 0
    returns from ``send()`` and closes."""
    REPLACE_SOURCE = "replace_source"
    """A train rank replaces one of its parameters with a new tensor before the step."""
    REPLACE_DESTINATION = "replace_destination"
    """A gen rank's engine replaces one of its tensors (without telling refit) before the step."""


@dataclass(frozen=True)
class CommitScenario:
    train: int
    gen: int
    mode: str
    tricks: tuple[tuple[int, Trick], ...] = ()
    timeout_s: float = 8.0

    def trick(self, rank: int) -> Trick:
        return dict(self.tricks).get(rank, Trick.NONE)


def toy_step(endpoint: RefitSender | RefitReceiver, model: ToyTrainer | ToyEngine, weights: int, version: int) -> None:
    """One refit step of a toy rank: a trainer loads reference weights ``weights`` and sends them as
    ``version``; an engine receives."""
    if isinstance(endpoint, RefitSender):
        assert isinstance(model, ToyTrainer)
        model.load(reference(0, weights))
        endpoint.send(version=version)
    else:
        endpoint.receive()


def _arm(trick: Trick) -> None:
    """Install ``trick`` in this process's commit protocol."""
    if trick is Trick.PAUSE_AFTER_VOTE:
        real_vote = commit.vote

        def slow_vote(rdv, step, ballot):
            real_vote(rdv, step, ballot)
            if ballot.landed:
                time.sleep(2.0)
        commit.vote = slow_vote
    elif trick is Trick.READ_DECISION_LATE:
        real_await = commit.await_decision

        def late_await(*args, **kwargs):
            time.sleep(2.0)
            return real_await(*args, **kwargs)
        commit.await_decision = late_await
    elif trick is Trick.DIE_AFTER_DECIDING:
        def die(*args, **kwargs):
            time.sleep(0.5)  # the decision reaches the ranks already waiting for it
            os.kill(os.getpid(), signal.SIGKILL)
        commit.await_settlements = die


def commit_rank(rank: int, report, address: str, scenario: CommitScenario) -> dict:
    """Rank ``rank`` (train ranks first) refits twice; its trick, if any, strikes in the second step."""
    train = rank < scenario.train
    local, size = (rank, scenario.train) if train else (rank - scenario.train, scenario.gen)
    options = RefitOptions(timeout_s=scenario.timeout_s, bucket_bytes=1024, num_buffers=2, mode=scenario.mode)
    model = ToyTrainer(local, size) if train else ToyEngine(local, size)
    endpoint = (RefitSender if train else RefitReceiver)(model, rendezvous=address, rank=local, world_size=size,
                                                         options=options)
    endpoint.setup()
    outcome: dict = {"side": "train" if train else "gen", "version": None}
    trick = scenario.trick(rank)
    for step, version in enumerate(VERSIONS):
        if step == 1:
            _arm(trick)
            if trick is Trick.REPLACE_SOURCE:
                name, (offsets, view) = next(iter(model.shards.items()))
                model.shards[name] = (offsets, view.clone())
            if trick is Trick.REPLACE_DESTINATION:
                model.norm = torch.zeros_like(model.norm)
        start = time.monotonic()
        try:
            toy_step(endpoint, model, step, version)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.update(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start)
            break
        outcome["seconds"] = time.monotonic() - start
        if train and step == 1 and trick is Trick.EXIT_AFTER_SEND:
            os._exit(0)
    if not train:
        outcome.update(state=_state(model, endpoint), version=endpoint.version, needs_refit=endpoint.needs_refit)
    endpoint.close()
    return outcome


def unrecognized_engine_rank(rank: int, report, address: str, train: int, gen: int, options: dict) -> dict:
    """A gen rank whose engine no plugin recognizes: its setup fails on its own checks, before it
    publishes anything but its failure."""
    local = rank - train
    start = time.monotonic()
    receiver = RefitReceiver(object(), rendezvous=address, rank=local, world_size=gen,
                             options=RefitOptions(**options))
    try:
        receiver.setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"ok": True}


def many_steps_rank(rank: int, report, address: str, train: int, gen: int, options: dict) -> dict:
    """Refit ``steps`` times; train rank 0 reports how many keys its store holds after each step."""
    is_train = rank < train
    local, size = (rank, train) if is_train else (rank - train, gen)
    steps = options.pop("steps")
    model = ToyTrainer(local, size) if is_train else ToyEngine(local, size)
    endpoint = (RefitSender if is_train else RefitReceiver)(model, rendezvous=address, rank=local, world_size=size,
                                                            options=RefitOptions(**options))
    endpoint.setup()
    held = []
    for step in range(steps):
        toy_step(endpoint, model, step % 2, step)
        if is_train:
            held.append(endpoint._rdv.client.num_keys())
    endpoint.close()
    return {"held": held}
