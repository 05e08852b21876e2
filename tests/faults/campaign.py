"""A randomized fault campaign: in each run one rank of a toy refit (2 train ranks, 2 gen ranks, gloo) is
killed, stopped or paused at a random point of its second step, in a random mode; then a census of what the
survivors hold and said.

The census counts, over all runs:

- *torn unreported*: a destination tensor on a surviving gen rank that is neither the version the rank
  reports nor named in its failure's ``torn`` list;
- *split and serving*: an engine whose ranks all survived, which would serve (no rank ``needs_refit``, every
  rank on one version: the rule the vLLM and SGLang plugins apply), while a rank holds other weights than
  that version;
- *late*: a survivor whose step (success or error) took longer than :func:`deadline_s`;
- *hung*: a survivor that never reported.

``benchmarks/fault_campaign.py`` runs a few hundred; ``tests/faults/test_campaign.py`` a few dozen.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from commit_ranks import VERSIONS, toy_step
from fault_ranks import _state
from harness import Ranks

from refit_core.endpoints.commit import DECISION_GRACE_S

TRAIN, GEN = 2, 2
PAUSE_S = 1.5
"""How long a paused rank sleeps (a descheduled process)."""
SLACK_S = 3.0
"""What a loaded 2-core machine may add to a deadline (process scheduling, a slow gloo teardown)."""


class Point(StrEnum):
    """Where in the second step the strike lands."""

    TRANSFER = "transfer"
    """Inside the transfer, at the rank's ``exchange``-th exchange."""
    AFTER_VOTE = "after_vote"
    """A gen rank, right after its vote that it landed the step."""
    AFTER_DECIDE = "after_decide"
    """Train rank 0, right after it published its decision."""
    AFTER_SETTLE = "after_settle"
    """A staged gen rank, right after it reported that it applied the decision."""
    AFTER_SEND = "after_send"
    """A train rank, right after ``send()`` returned."""


class Action(StrEnum):
    KILL = "kill"
    """SIGKILL."""
    STOP = "stop"
    """SIGSTOP, never continued (the rank is killed once the survivors are done)."""
    PAUSE = "pause"
    """Sleep :data:`PAUSE_S`, then carry on."""


@dataclass(frozen=True)
class Strike:
    rank: int
    """Global rank: train ranks first."""
    point: Point
    action: Action
    exchange: int = 1


@dataclass(frozen=True)
class Run:
    index: int
    mode: str
    strike: Strike
    timeout_s: float = 4.0


def draw(rng: random.Random, index: int) -> Run:
    """One random run."""
    mode = rng.choice(["staged", "in_place"])
    rank = rng.randrange(TRAIN + GEN)
    if rank >= TRAIN:
        points = [Point.TRANSFER, Point.AFTER_VOTE] + ([Point.AFTER_SETTLE] if mode == "staged" else [])
    else:
        points = [Point.TRANSFER, Point.AFTER_SEND] + ([Point.AFTER_DECIDE] if rank == 0 else [])
    strike = Strike(rank, rng.choice(points), rng.choice(list(Action)), rng.randint(1, 4))
    return Run(index, mode, strike)


def deadline_s(run: Run) -> float:
    """How long a survivor's step may take, success or error: the transfer's deadline, then the commit's
    (the decision's grace included), a paused rank's pause and a loaded machine's slack."""
    return 2 * run.timeout_s + DECISION_GRACE_S + PAUSE_S + SLACK_S


def _hit(action: Action) -> None:
    if action is Action.PAUSE:
        time.sleep(PAUSE_S)
    else:
        os.kill(os.getpid(), signal.SIGKILL if action is Action.KILL else signal.SIGSTOP)


def _arm(endpoint, strike: Strike) -> None:
    """Install the strike in this process, to land in the step about to start."""
    from refit_core.endpoints import commit

    if strike.point is Point.TRANSFER and endpoint._executor is not None:
        transport = endpoint._executor.transport
        real_exchange, calls = transport.exchange, [0]

        def exchange(sends, recvs, after=(), **options):
            calls[0] += 1
            if calls[0] == strike.exchange:
                _hit(strike.action)
            return real_exchange(sends, recvs, after, **options)
        transport.exchange = exchange
    wrapped = {Point.AFTER_VOTE: "vote", Point.AFTER_DECIDE: "decide", Point.AFTER_SETTLE: "settle"}
    name = wrapped.get(strike.point)
    if name is not None:
        real = getattr(commit, name)

        def struck(*args, **kwargs):
            result = real(*args, **kwargs)
            if name != "vote" or args[2].landed:
                _hit(strike.action)
            return result
        setattr(commit, name, struck)


def campaign_rank(rank: int, report, address: str, run: Run) -> dict:
    """One rank of a campaign run: two steps, the strike (if it is this rank's) in the second."""
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core import RefitOptions, RefitReceiver, RefitSender

    train = rank < TRAIN
    local, size = (rank, TRAIN) if train else (rank - TRAIN, GEN)
    options = RefitOptions(timeout_s=run.timeout_s, bucket_bytes=1024, num_buffers=2, mode=run.mode)
    model = ToyTrainer(local, size) if train else ToyEngine(local, size)
    endpoint = (RefitSender if train else RefitReceiver)(model, rendezvous=address, rank=local, world_size=size,
                                                         options=options)
    outcome: dict = {"side": "train" if train else "gen", "failed_step": None}
    try:
        endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - a setup failure voids the run (the strike comes later)
        return {**outcome, "failed_step": -1, "error": type(exc).__name__, "message": str(exc)}
    mine = run.strike.rank == rank
    for step, version in enumerate(VERSIONS):
        if step == 1 and mine:
            _arm(endpoint, run.strike)
        start = time.monotonic()
        try:
            toy_step(endpoint, model, step, version)
        except Exception as exc:  # noqa: BLE001 - the census inspects it
            failure = getattr(exc, "failure", None)
            outcome.update(failed_step=step, error=type(exc).__name__, message=str(exc)[:400],
                           torn=list(failure.torn) if failure else [])
            break
        finally:
            outcome["seconds"] = time.monotonic() - start
        if step == 1 and mine and run.strike.point is Point.AFTER_SEND:
            _hit(run.strike.action)
    if not train:
        outcome.update(state=_state(model, endpoint), version=endpoint.version, needs_refit=endpoint.needs_refit)
    endpoint.close()
    return outcome


@dataclass
class Census:
    """What the campaign found; a clean campaign has no problems."""

    runs: int = 0
    void: int = 0
    """Runs in which a step before the strike failed (a loaded machine): nothing to judge."""
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    slowest: float = 0.0
    """The slowest survivor's step, as a fraction of its deadline."""

    def judge(self, run: Run, results: dict[int, dict | None]) -> None:
        """Add one run: ``results`` maps every rank that was not struck dead to what it reported (None: hung)."""
        self.runs += 1
        what = f"run {run.index} ({run.mode}, {run.strike.action.value} rank {run.strike.rank} at " \
               f"{run.strike.point.value}#{run.strike.exchange})"
        hung = [rank for rank, r in results.items() if r is None]
        if hung:
            self.problems.append(f"{what}: ranks {hung} hung")
        done = {rank: r for rank, r in results.items() if r is not None}
        if any(r["failed_step"] is not None and r["failed_step"] < 1 for r in done.values()):
            self.void += 1
            return
        for rank, r in done.items():
            if r["seconds"] > deadline_s(run):
                self.problems.append(f"{what}: rank {rank} took {r['seconds']:.1f} s > {deadline_s(run):.1f} s")
            self.slowest = max(self.slowest, r["seconds"] / deadline_s(run))
        gen = {rank: r for rank, r in done.items() if r["side"] == "gen"}
        for rank, r in gen.items():
            expected = {VERSIONS[0]: "old", VERSIONS[1]: "new"}[r["version"]]
            unreported = [n for n, s in r["state"].items() if s != expected and n not in r.get("torn", [])]
            if unreported:
                self.problems.append(f"{what}: gen rank {rank - TRAIN} holds {unreported} unreported "
                                     f"(version {r['version']})")
        if len(gen) == GEN:
            serves = not any(r["needs_refit"] for r in gen.values()) and len({r["version"] for r in gen.values()}) == 1
            whole = all(set(r["state"].values()) == {"old" if r["version"] == VERSIONS[0] else "new"}
                        for r in gen.values())
            if serves and not whole:
                self.problems.append(f"{what}: the engine would serve split or torn weights")
            self.outcomes["engine serves " + ("new" if serves and gen[TRAIN]["version"] == VERSIONS[1] else
                                              "old" if serves else "nothing (refit again)")] += 1
        else:
            self.outcomes["engine lost a rank"] += 1

    def summary(self) -> str:
        lines = [f"{self.runs} runs ({self.void} void), slowest survivor at {self.slowest:.2f} of its deadline",
                 *(f"  {k}: {v}" for k, v in sorted(self.outcomes.items())),
                 f"  problems: {len(self.problems)}", *(f"    {p}" for p in self.problems)]
        return "\n".join(lines)


def execute(run: Run) -> dict[int, dict | None]:
    """Run one campaign run; every rank that was not killed reports (a stopped rank is killed at the end)."""
    from refit_core.kit.launch import free_port

    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    everyone = range(TRAIN + GEN)
    dead = {run.strike.rank} if run.strike.action is not Action.PAUSE else set()
    survivors = [r for r in everyone if r not in dead]
    try:
        for rank in everyone:
            ranks.start(campaign_rank, rank, address, run)
        ranks.release()
        limit = deadline_s(run) + 30  # the steps before the strike and setup
        results: dict[int, dict | None] = {}
        deadline = time.monotonic() + limit
        for rank in survivors:
            try:
                got = ranks.wait_for([(rank, "result")], timeout_s=max(1.0, deadline - time.monotonic()))
                results[rank] = got[(rank, "result")]
            except AssertionError:
                results[rank] = None
        return results
    finally:
        ranks.close()


def campaign(runs: int, seed: int, progress=None) -> Census:
    """``runs`` random runs from ``seed``; ``progress(i, run, census)`` after each."""
    rng = random.Random(seed)
    census = Census()
    for index in range(runs):
        run = draw(rng, index)
        census.judge(run, execute(run))
        if progress is not None:
            progress(index, run, census)
    return census
