"""The commit point of a step: every gen rank votes, train rank 0 alone decides, every rank reads that decision.

One step, in order (every key is :mod:`refit_core.net.keys`'):

1. each gen rank, once the step landed (staged: in its staging buffers; in place: in engine memory), or
   once it failed, writes its :class:`Vote` under ``landed/STEP/gen/RANK``;
2. train rank 0 (the store's host) waits for every vote, or for the first sign that one will never come
   (a gen rank that left, the deadline), and writes the one :class:`Decision` under ``decision/STEP``:
   :attr:`Verdict.COMMIT` only if every gen rank landed the step;
3. every other rank reads that decision. In staged mode a gen rank applies the step only on
   :attr:`Verdict.COMMIT`, then reports what it did (:class:`Settlement`, ``settled/STEP/gen/RANK``); train
   rank 0's ``send()`` returns only once every gen rank that voted *landed* has settled, so a trainer that
   exits right after ``send()`` never takes the decision away from a gen rank that has yet to read it.

A gen rank that cannot read the decision within its deadline (the store's host stopped or died) does
not guess: it keeps its previous weights, marks itself ``needs_refit`` and says so; other gen ranks may
have applied the step, so its engine must not serve until the next successful step. In place, step 3
is train-side only (with ``RefitOptions.confirm``): the gen ranks' weights already changed, and the
decision tells the trainers whether every gen rank landed the step.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from refit_core.contract.errors import RefitError, TransferError, WireError
from refit_core.contract.side import Side
from refit_core.net.keys import (
    TRANSPORT_FAILED,
    RankId,
    decision_key,
    failed_key,
    heard_key,
    landed_key,
    settled_key,
    step_prefixes,
)
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.transport.watch import REASON_CHARS as CAUSE_CHARS
from refit_core.net.transport.watch import RankNames

REASON_CHARS = 500
"""How much of a failed rank's error its vote carries."""
DECIDER = RankId(Side.TRAIN, 0)
"""Who decides every step: the store's host."""
DECISION_GRACE_S = 2.0
"""How much longer than ``timeout_s`` (at most twice it) a rank waits for the decision on a step: the
decider may have started waiting for the last vote up to ``timeout_s`` before it arrived."""


class Verdict(StrEnum):
    """What train rank 0 decided about a step."""

    COMMIT = "commit"
    """Every gen rank landed the step: staged gen ranks apply it."""
    ABORT = "abort"
    """Some gen rank did not land it (or never voted): staged gen ranks keep their previous weights."""


class DecisionUnknown(TransferError):
    """A rank could not learn a step's decision within its deadline (the store's host stopped or died)."""


@dataclass(frozen=True)
class Vote:
    """A gen rank's vote on a step: ``reason`` is None if it landed the step, else why not."""

    rank: int
    reason: str | None = None

    @property
    def landed(self) -> bool:
        return self.reason is None

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True} if self.reason is None else {"ok": False, "reason": self.reason[:REASON_CHARS]}

    @classmethod
    def from_wire(cls, rank: int, value: Any) -> Vote:
        if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
            raise WireError(f"gen rank {rank}'s vote is malformed")
        return cls(rank, None if value["ok"] else str(value.get("reason"))[:REASON_CHARS])


@dataclass(frozen=True)
class Decision:
    """Train rank 0's decision on a step of weight ``version``; ``reason`` says why it aborted (None on commit)."""

    step: int
    version: int
    verdict: Verdict
    reason: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "verdict": self.verdict.value, "reason": self.reason}

    @classmethod
    def from_wire(cls, value: Any) -> Decision:
        if not (isinstance(value, dict) and type(value.get("step")) is int and type(value.get("version")) is int
                and value.get("verdict") in tuple(Verdict)):
            raise WireError("train rank 0's decision on a step is malformed")
        reason = value.get("reason")
        return cls(value["step"], value["version"], Verdict(value["verdict"]),
                   None if reason is None else str(reason)[:REASON_CHARS])


@dataclass(frozen=True)
class Settlement:
    """What a staged gen rank did with a decision: the ``version`` it holds now; ``reason`` None if it
    applied the decision, else why it could not (its weights are then torn)."""

    rank: int
    version: int | None
    reason: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "reason": self.reason}

    @classmethod
    def from_wire(cls, rank: int, value: Any) -> Settlement:
        if not isinstance(value, dict) or not (value.get("version") is None or type(value.get("version")) is int):
            raise WireError(f"gen rank {rank}'s settlement is malformed")
        reason = value.get("reason")
        return cls(rank, value["version"], None if reason is None else str(reason)[:REASON_CHARS])


# -- gen ranks ------------------------------------------------------------------------------


def vote(rdv: Rendezvous, step: int, ballot: Vote) -> None:
    """Write a gen rank's vote on ``step``."""
    rdv.publish(landed_key(step, ballot.rank), ballot.to_wire())


def await_decision(rdv: Rendezvous, step: int, timeout_s: float) -> Decision:
    """Train rank 0's decision on ``step``; :class:`DecisionUnknown` if it cannot be read within ``timeout_s``
    and :data:`DECISION_GRACE_S` (only train rank 0's departure or silence matters: it alone decides)."""
    try:
        (value,) = rdv.wait([decision_key(step)], f"train rank 0's decision on step {step}",
                            timeout_s=timeout_s + min(timeout_s, DECISION_GRACE_S), watched={str(DECIDER)})
    except RefitError as exc:
        raise DecisionUnknown(f"could not learn train rank 0's decision on step {step} ({exc})") from exc
    decision = Decision.from_wire(value)
    if decision.step != step:
        raise WireError(f"train rank 0's decision is on step {decision.step}, not {step}")
    return decision


def settle(rdv: Rendezvous, step: int, settlement: Settlement) -> None:
    """Report what a staged gen rank did with the decision on ``step`` (best effort: train rank 0 may be gone)."""
    try:
        rdv.publish(settled_key(step, settlement.rank), settlement.to_wire())
    except RefitError:
        pass


# -- train rank 0 ---------------------------------------------------------------------------


def decide(rdv: Rendezvous, step: int, version: int, gen_size: int, timeout_s: float,
           failure: str | None = None, readers: bool = True) -> tuple[Decision, list[Vote]]:
    """Collect every gen rank's vote on ``step``, decide and publish the decision (unless no rank reads it:
    ``readers`` False); returns it with the votes that arrived. ``failure`` (this rank's own failed step)
    aborts without waiting."""
    votes: list[Vote] = []
    reason = failure
    deadline = time.monotonic() + timeout_s
    if reason is None:
        for rank in range(gen_size):  # in rank order: the first missing vote blocks, the rest are quick
            who = RankId(Side.GEN, rank)
            try:
                (value,) = rdv.wait([landed_key(step, rank)], f"{who.name}'s vote on step {step}",
                                    timeout_s=_left(deadline), watched={str(who)})
            except RefitError as exc:
                reason = f"{who.name} did not vote on step {step}: {exc}"
                break
            ballot = Vote.from_wire(rank, value)
            votes.append(ballot)
            if not ballot.landed:
                reason = f"gen rank {rank} did not land step {step} ({ballot.reason})"
                break
    decision = Decision(step, version, Verdict.COMMIT if reason is None else Verdict.ABORT, reason)
    if readers:
        rdv.publish(decision_key(step), decision.to_wire())
    forget_old_steps(rdv, step)
    return decision, votes


# -- train ranks other than the decider --------------------------------------------------------


HEARD_S = 5.0
"""How long, at most, train rank 0 keeps the store up at ``close()`` for the other train ranks to read its
last commit decision (:func:`await_hearers`): a slow rank, not a stopped one, is what it waits for."""


def heard(rdv: Rendezvous, step: int, train_rank: int) -> None:
    """Train rank ``train_rank`` read the decision on ``step`` (best effort: never raises)."""
    try:
        rdv.client.set(heard_key(step, train_rank), b"1", within=CAUSE_READ_S)
    except RefitError:
        pass


def await_hearers(rdv: Rendezvous, step: int, train_size: int, timeout_s: float) -> None:
    """Train rank 0, about to stop the store: wait until every other train rank read the decision on ``step``
    (:func:`heard`), or left, or :data:`HEARD_S` (at most ``timeout_s``) passed."""
    rdv.linger([heard_key(step, rank) for rank in range(1, train_size)], timeout_s=min(timeout_s, HEARD_S))


KEPT_STEPS = 2
"""How many recent steps' commit keys the store keeps at least: every rank has long read older ones (a
step cannot start on the gen side before the previous one settled)."""
FORGET_EVERY = 4
"""Train rank 0 deletes old steps' commit keys once every this many steps, in one request."""


def forget_old_steps(rdv: Rendezvous, step: int) -> None:
    """Train rank 0, once ``step`` is decided: every :data:`FORGET_EVERY` steps, delete the commit keys of
    the steps before ``step - KEPT_STEPS`` not yet deleted (one request, whatever the world size)."""
    last = step - KEPT_STEPS
    if last >= 0 and (last + 1) % FORGET_EVERY == 0:
        rdv.client.delete_prefixed([p for old in range(last + 1 - FORGET_EVERY, last + 1) for p in step_prefixes(old)])


def await_settlements(rdv: Rendezvous, step: int, ranks: Collection[int], timeout_s: float) -> list[Settlement]:
    """The settlements of the gen ``ranks`` on ``step``, each awaited until ``timeout_s`` or until its rank
    left; a rank that did neither in time is missing from the result."""
    settled = []
    deadline = time.monotonic() + timeout_s
    for rank in ranks:
        who = RankId(Side.GEN, rank)
        try:
            (value,) = rdv.wait([settled_key(step, rank)], f"{who.name} to settle step {step}",
                                timeout_s=_left(deadline), watched={str(who)})
        except RefitError:
            continue
        settled.append(Settlement.from_wire(rank, value))
    return settled


def drain(rdv: Rendezvous, step: int, gen_size: int, timeout_s: float) -> None:
    """After an abort decided without waiting for the votes (train rank 0's own step failed): keep the
    store up until every gen rank either voted that it did not land ``step``, or landed it and settled
    (it read the abort), or left, or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    for rank in range(gen_size):
        who = RankId(Side.GEN, rank)
        try:
            (value,) = rdv.wait([landed_key(step, rank)], f"{who.name}'s vote on step {step}",
                                timeout_s=_left(deadline), watched={str(who)})
            if Vote.from_wire(rank, value).landed:
                rdv.wait([settled_key(step, rank)], f"{who.name} to settle step {step}", timeout_s=_left(deadline),
                         watched={str(who)})
        except RefitError:
            continue


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def unsettled_report(decision: Decision, ranks: Collection[int], settled: list[Settlement]) -> str | None:
    """None if every gen rank in ``ranks`` applied ``decision``; else which ranks hold which version."""
    applied = [s.rank for s in settled if s.reason is None]
    failed = [s for s in settled if s.reason is not None]
    silent = sorted(set(ranks) - {s.rank for s in settled})
    if not failed and not silent:
        return None
    parts = [f"gen rank(s) {applied} applied version {decision.version}"] if applied else []
    parts += [f"gen rank {s.rank} failed to apply it ({s.reason}; it holds torn weights and refuses to serve)"
              for s in failed]
    if silent:
        parts.append(f"gen rank(s) {silent} did not confirm in time (each holds its previous version or "
                     f"{decision.version}; one that could not read the decision refuses to serve)")
    return f"step {decision.step} was committed, but not everywhere: {'; '.join(parts)}"


# -- the first failure of a step ------------------------------------------------------------


CAUSE_READ_S = 1.0
"""How long a failed rank waits for the store's answer when it looks up or notes a failed step."""
LINGER_S = 2.0
"""How long, at most, train rank 0 keeps the store up after its own failed step, for the other ranks to
read why the step failed (:func:`step_failed`)."""


def step_failed(rdv: Rendezvous | None, step: int, me: RankId, train: int, error: str) -> str | None:
    """Rank ``me`` failed ``step`` for ``error`` (``train``: the train side's world size). Returns why
    another rank gave up on it first, as an error names it (None: no other rank did, ``error`` says so
    already, or the store cannot tell); then publishes ``error`` where the transports' watch looks, unless
    a rank did first, so that peers waiting on this one, or failing because it closed its transport, name
    the cause (a refused version or subset fails before any byte moves); then notes that this rank
    failed, for :func:`linger`. Best effort, each request bounded: the store's host may be gone."""
    if rdv is None:
        return None
    names = RankNames(train)
    cause = None
    try:
        raw = rdv.client.try_get(TRANSPORT_FAILED, within=CAUSE_READ_S)
        if raw is None:
            rdv.client.compare_set(TRANSPORT_FAILED, b"", f"{names.global_rank(me)} {error[:CAUSE_CHARS]}")
        else:
            who, _, reason = bytes(raw).decode(errors="replace").partition(" ")
            if who.isdigit() and int(who) != names.global_rank(me) and reason not in error:
                cause = f"{names.name(int(who))} gave up on the step first: {reason}"
        rdv.client.set(failed_key(step, me), b"1", within=CAUSE_READ_S)
    except RefitError:
        pass
    return cause


def linger(rdv: Rendezvous, step: int, sizes: Mapping[Side, int], timeout_s: float) -> None:
    """Train rank 0 failed ``step``: keep the store up until every other rank noted that it failed too
    (:func:`step_failed`: it has read the cause), or left, or :data:`LINGER_S` (at most ``timeout_s``) passed."""
    deadline = time.monotonic() + min(timeout_s, LINGER_S)
    for side, size in sizes.items():
        for rank in range(size):
            who = RankId(side, rank)
            if who == DECIDER:
                continue
            try:
                rdv.wait([failed_key(step, who)], f"{who.name} to note the failed step {step}",
                         timeout_s=_left(deadline), watched={str(who)})
            except RefitError:
                continue


__all__ = ["DECIDER", "DECISION_GRACE_S", "Decision", "DecisionUnknown", "Settlement", "Verdict", "Vote",
           "await_decision", "await_hearers", "await_settlements", "decide", "drain", "forget_old_steps", "heard",
           "linger", "settle", "step_failed", "unsettled_report", "vote"]
