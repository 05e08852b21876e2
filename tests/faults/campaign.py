"""A randomized fault campaign: in each run one or two ranks of a toy refit (2 train ranks, 2 gen ranks, gloo)
are killed, stopped, paused briefly or stalled past the deadline at random points of the second step, in a
random mode; in some runs a second job shares the host (its ranks on the same port, with their own secret).
In others, one rank's model changes one of its tensors' memory behind refit's back between the two steps
(rebinds it, ``set_()``s it, resizes or frees its storage: :mod:`memory_strikes`).
Then the job sets up again (new endpoints on the same port, a replacement process for each rank that died or
was stopped, as an operator would) and refits once more. :mod:`census` judges what the survivors hold and said.

``benchmarks/fault_campaign.py`` runs a few hundred; ``tests/faults/test_campaign.py`` a few dozen.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum

from census import Census
from commit_ranks import VERSIONS, toy_step
from fault_ranks import _state_against
from harness import Ranks
from memory_strikes import MemoryStrike, arm, held, plugins, random_strike, recover
from two_jobs_ranks import SEEDS, job_rank

from refit_core.endpoints.commit import DECISION_GRACE_S, LINGER_S

TRAIN, GEN = 2, 2
PAUSE_S = 1.5
"""How long a paused rank sleeps (a descheduled process)."""
SLACK_S = 3.0
"""What a loaded 2-core machine may add to a deadline (process scheduling, a slow gloo teardown)."""
SECRET, INTRUDER_SECRET = "fault-campaign", "fault-campaign-intruder"
JOB_ENV, INTRUDER_ENV = {"REFIT_SECRET": SECRET}, {"REFIT_SECRET": INTRUDER_SECRET}
"""Each job's secret, in its ranks' environment: an environment override wins over ``RefitOptions(secret=...)``,
so a ``REFIT_SECRET`` the ranks inherited (the suite sets one: ``tests/conftest.py``) made the two jobs one."""
RECOVERY = (2, VERSIONS[1] + 1)
"""The recovery step's reference weights and version."""
RECOVERY_TIMEOUT_S = 60.0
"""The second setup's deadline: a replacement process starts slowly on a loaded machine."""
MEMORY_SHARE = 0.3
"""The share of runs whose strike is a memory fault instead of process faults."""


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
    """SIGSTOP, never continued (the rank is killed once the survivors are done, then replaced)."""
    PAUSE = "pause"
    """Sleep :data:`PAUSE_S`, then carry on."""
    STALL = "stall"
    """Sleep longer than the step's deadline (:func:`stall_s`), then carry on."""


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
    strikes: tuple[Strike, ...]
    timeout_s: float = 4.0
    two_jobs: bool = False
    """A second job's train and gen rank start on the same port while this job sets up."""
    memory: MemoryStrike | None = None
    """A memory fault right before one rank's second step (then :attr:`strikes` is empty)."""

    def describe(self) -> str:
        hits = [f"{s.action.value} rank {s.rank} at {s.point.value}#{s.exchange}" for s in self.strikes]
        hits += [self.memory.describe()] if self.memory is not None else []
        return f"run {self.index} ({self.mode}, {', '.join(hits)}{', two jobs' if self.two_jobs else ''})"

    @property
    def dead(self) -> set[int]:
        """The ranks struck dead or stopped: replaced for the recovery."""
        return {s.rank for s in self.strikes if s.action in (Action.KILL, Action.STOP)}


def _strike(rng: random.Random, rank: int, mode: str) -> Strike:
    if rank >= TRAIN:
        points = [Point.TRANSFER, Point.AFTER_VOTE] + ([Point.AFTER_SETTLE] if mode == "staged" else [])
    else:
        points = [Point.TRANSFER, Point.AFTER_SEND] + ([Point.AFTER_DECIDE] if rank == 0 else [])
    return Strike(rank, rng.choice(points), rng.choice(list(Action)), rng.randint(1, 4))


def draw(rng: random.Random, index: int) -> Run:
    """One random run: a memory fault (:data:`MEMORY_SHARE` of runs), else one strike or two on different
    ranks; a second job on the host in one run of four."""
    mode = rng.choice(["staged", "in_place"])
    if rng.random() < MEMORY_SHARE:
        return Run(index, mode, (), two_jobs=rng.random() < 0.25, memory=random_strike(rng, TRAIN, GEN))
    ranks = rng.sample(range(TRAIN + GEN), rng.choice([1, 1, 2]))
    return Run(index, mode, tuple(_strike(rng, rank, mode) for rank in sorted(ranks)), two_jobs=rng.random() < 0.25)


def stall_s(run: Run) -> float:
    """How long a stalled rank sleeps: past the step's deadline."""
    return run.timeout_s + 1.0


def deadline_s(run: Run, rank: int | None = None) -> float:
    """How long a survivor's step may take, success or error: the transfer's deadline, then the commit's
    (the decision's grace included), train rank 0 keeping the store up for the others after its failure,
    a paused rank's pause and a loaded machine's slack; a stalled ``rank`` its stall on top."""
    stalled = any(s.rank == rank and s.action is Action.STALL for s in run.strikes)
    return 2 * run.timeout_s + DECISION_GRACE_S + LINGER_S + PAUSE_S + SLACK_S + (stall_s(run) if stalled else 0)


def _hit(action: Action, run: Run) -> None:
    if action is Action.PAUSE:
        time.sleep(PAUSE_S)
    elif action is Action.STALL:
        time.sleep(stall_s(run))
    else:
        os.kill(os.getpid(), signal.SIGKILL if action is Action.KILL else signal.SIGSTOP)


_COMMIT_STEPS = ("vote", "decide", "settle")


def _disarm() -> None:
    """Take back the strike :func:`_arm` put into the commit protocol: the recovery runs without it."""
    from refit_core.endpoints import commit

    for name in _COMMIT_STEPS:
        real = getattr(getattr(commit, name), "real", None)
        if real is not None:
            setattr(commit, name, real)


def _arm(endpoint, strike: Strike, run: Run) -> None:
    """Install the strike in this process, to land in the step about to start."""
    from refit_core.endpoints import commit

    if strike.point is Point.TRANSFER and endpoint._executor is not None:
        transport = endpoint._executor.transport
        real_exchange, calls = transport.exchange, [0]

        def exchange(sends, recvs, after=(), **options):
            calls[0] += 1
            if calls[0] == strike.exchange:
                _hit(strike.action, run)
            return real_exchange(sends, recvs, after, **options)
        transport.exchange = exchange
    wrapped = {Point.AFTER_VOTE: "vote", Point.AFTER_DECIDE: "decide", Point.AFTER_SETTLE: "settle"}
    name = wrapped.get(strike.point)
    if name is not None:
        real = getattr(commit, name)

        def struck(*args, **kwargs):
            result = real(*args, **kwargs)
            if name != "vote" or args[2].landed:
                _hit(strike.action, run)
            return result
        struck.real = real  # type: ignore[attr-defined]
        setattr(commit, name, struck)


def _endpoint(rank: int, address: str, options, run: Run):
    """Rank ``rank``'s model and a new endpoint for it (train ranks first), with the run's plugins."""
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core import RefitReceiver, RefitSender

    train = rank < TRAIN
    local, size = (rank, TRAIN) if train else (rank - TRAIN, GEN)
    model = ToyTrainer(local, size) if train else ToyEngine(local, size)
    lists = run.memory is None or run.memory.lists
    endpoint = (RefitSender if train else RefitReceiver)(model, rendezvous=address, rank=local, world_size=size,
                                                         options=options, plugins=plugins(lists))
    return model, endpoint


def _options(run: Run, timeout_s: float):
    from refit_core import RefitOptions

    return RefitOptions(timeout_s=timeout_s, bucket_bytes=1024, num_buffers=2, mode=run.mode)


def campaign_rank(rank: int, report, address: str, run: Run, again: str) -> dict:
    """One rank of a campaign run: two steps, its strike (if any) in the second; then, once the file ``again``
    exists (every dead rank replaced), the recovery (:func:`recovery_rank`) with a new endpoint."""
    model, endpoint = _endpoint(rank, address, _options(run, run.timeout_s), run)
    outcome: dict = {"side": "train" if rank < TRAIN else "gen", "failed_step": None}
    try:
        endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - a setup failure voids the run (the strike comes later)
        outcome.update(failed_step=-1, error=type(exc).__name__, message=str(exc))
        report("phase", outcome)
        return outcome
    mine = next((s for s in run.strikes if s.rank == rank), None)
    for step, version in enumerate(VERSIONS):
        if step == 1 and mine is not None:
            _arm(endpoint, mine, run)
        if step == 1 and run.memory is not None and run.memory.rank == rank:
            arm(endpoint, model, run.memory)
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
        if step == 1 and mine is not None and mine.point is Point.AFTER_SEND:
            _hit(mine.action, run)
    if rank >= TRAIN:
        outcome.update(state=held(model, endpoint), version=endpoint.version, needs_refit=endpoint.needs_refit)
    endpoint.close()
    report("phase", outcome)
    _disarm()
    if _gate_opens(again, RECOVERY_TIMEOUT_S):
        outcome["recovery"] = recovery_rank(rank, report, address, run, model)
    return outcome


def _gate_opens(gate: str, timeout_s: float) -> bool:
    """Whether the file ``gate`` appears within ``timeout_s``. A file, not a ``multiprocessing.Event``: its
    ``set()`` waits for every process sleeping in ``wait()`` to wake, forever for one that was killed there
    (a rank struck dead whose strike never came, killed by the test all the same)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def recovery_rank(rank: int, report, address: str, run: Run, model=None) -> dict:
    """The job sets up again after the fault, as a user would: a new endpoint (in a replacement process
    for a rank that died: ``model`` None), on the same port, then one more step (:data:`RECOVERY`)."""
    weights, version = RECOVERY
    fresh, endpoint = _endpoint(rank, address, _options(run, RECOVERY_TIMEOUT_S), run)
    if model is not None:
        recover(model)
        endpoint.model = model
    try:
        endpoint.setup()
        toy_step(endpoint, endpoint.model, weights, version)
        bitwise = rank < TRAIN or _state_against(endpoint.model, endpoint, weights)
    except Exception as exc:  # noqa: BLE001 - the census inspects it
        return {"error": type(exc).__name__, "message": str(exc)[:400]}
    finally:
        endpoint.close()
    return {"bitwise": bitwise}


def _intrude(ranks: Ranks, address: str) -> None:
    """A second job (one train rank, one gen rank, its own secret) starts on this job's port once it listens."""
    import socket

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    for rank, train in ((INTRUDER, True), (INTRUDER + 1, False)):
        ranks.start(job_rank, rank, address, train, INTRUDER_SEED, {"timeout_s": 10}, env=INTRUDER_ENV)


INTRUDER = 100
"""The other job's ranks' numbers in the harness."""
INTRUDER_SEED = SEEDS[0]
"""The other job's weights (``reference(INTRUDER_SEED, 0)``): it may set up between this job's two setups."""


def _collect(ranks: Ranks, wanted: list[int], event: str, limit_s: float) -> dict[int, dict | None]:
    """Each rank's ``event`` payload, None for a rank that sent none within ``limit_s`` in all."""
    deadline = time.monotonic() + limit_s
    out: dict[int, dict | None] = {}
    for rank in wanted:
        try:
            out[rank] = ranks.wait_for([(rank, event)], timeout_s=max(1.0, deadline - time.monotonic()))[(rank, event)]
        except AssertionError:
            out[rank] = None
    return out


def execute(run: Run) -> tuple[dict[int, dict | None], dict[int, dict | None], dict | None]:
    """Run one campaign run. Returns what every rank not struck dead reported (its fault phase, with its
    ``recovery``; None: hung), the replacements' recoveries by rank, and the other job's engine's report
    (None without one)."""
    from refit_core.kit.launch import free_port

    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    everyone = range(TRAIN + GEN)
    survivors = [r for r in everyone if r not in run.dead]
    again = os.path.join(tempfile.mkdtemp(prefix="refit-campaign-"), "again")
    try:
        for rank in everyone:
            ranks.start(campaign_rank, rank, address, run, again, env=JOB_ENV)
        ranks.release()
        if run.two_jobs:
            _intrude(ranks, address)
        phase = _collect(ranks, survivors, "phase", max(deadline_s(run, r) for r in everyone) + 30)
        intruder = _collect(ranks, [INTRUDER + 1], "result", 30)[INTRUDER + 1] if run.two_jobs else None
        if intruder is not None:  # no byte of this job: nothing written, or its own weights whole
            intruder["own_only"] = intruder.get("untouched") or intruder.get("holds") == [INTRUDER_SEED]
        if any(r is None for r in phase.values()):
            return phase, {}, intruder
        for rank in sorted(run.dead):  # as an operator would: end what is left of it, start a replacement
            ranks.kill(rank)
            ranks.start(recovery_rank, rank, address, run, env=JOB_ENV)
        open(again, "w").close()
        done = _collect(ranks, [*survivors, *sorted(run.dead)], "result", RECOVERY_TIMEOUT_S + 30)
        results: dict[int, dict | None] = {}
        for rank in survivors:  # one that did not report its recovery: its fault phase, recovery None
            results[rank] = done[rank] if done[rank] is not None else {**(phase[rank] or {}), "recovery": None}
        return results, {rank: done[rank] for rank in sorted(run.dead)}, intruder
    finally:
        ranks.close()
        shutil.rmtree(os.path.dirname(again), ignore_errors=True)


def campaign(runs: int, seed: int, progress=None, *, timeout_s: float = 4.0, workers: int = 1) -> Census:
    """``runs`` random runs from ``seed`` at step deadline ``timeout_s`` (:func:`census_of`)."""
    rng = random.Random(seed)
    return census_of([dataclasses.replace(draw(rng, index), timeout_s=timeout_s) for index in range(runs)],
                     progress, workers)


def census_of(runs: list[Run], progress=None, workers: int = 1) -> Census:
    """The census of ``runs``, ``workers`` of them at a time (their ranks mostly wait: on deadlines, pauses,
    stopped peers); ``progress(i, run, census)`` after each, in order."""
    from concurrent.futures import ThreadPoolExecutor

    census = Census()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for run, (results, replacements, intruder) in zip(runs, pool.map(execute, runs)):
            census.strikes += len(run.strikes) + (run.memory is not None)
            deadlines = {rank: deadline_s(run, rank) for rank in range(TRAIN + GEN)}
            census.judge(run.describe(), run.mode, TRAIN, GEN, results, deadlines, replacements, intruder, run.memory)
            if progress is not None:
                progress(run.index, run, census)
    return census
