"""A randomized campaign of membership faults in a fleet (:mod:`refit_core.fleet`): in each run 1 or 2 train ranks
refit 3 toy replicas of 1 or 2 ranks each over gloo for :data:`STEPS` steps, in a random mode, and one or two
membership strikes land at random steps: a replica rank SIGKILLed or SIGSTOPped at a random point of a step
(inside its transfer, after its vote, after it settled, or right after the step, before the next), a stopped
rank killed later; the struck replica restarted under its name (its other rank, if it has two, joins again by
itself); a new replica added; an impostor asking to join under a live replica's name. In half the runs the
trainers feed ``r0`` alone, which forwards each step to ``r1`` and ``r2`` (``FleetOptions(direct=1)``), and a rank
strike hits that relay parent half the time, inside its own transfer, while it forwards, or around its commit.
:mod:`fleet_census` judges every run.

``benchmarks/fleet_campaign.py`` runs a few hundred; ``tests/faults/test_fleet_campaign.py`` a few dozen.
"""

from __future__ import annotations

import itertools
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fleet_census import Census
from fleet_ranks import FIRST_VERSION, Action, Hit, Point, RankLog, fleet_rank, gate, start_path, trainer_rank
from harness import Ranks

from refit_core.endpoints.commit import DECISION_GRACE_S, LINGER_S

REPLICAS = 3
STEPS = 6
FIRST_ID = 10
"""The harness numbers of replica ranks start here (train ranks are 0 and 1)."""
SECRET = "fleet-campaign"
SLACK_S = 3.0
"""What a step may take beyond ``timeout_s`` without a failed replica: new replicas' setups, a killed rank
noticed, a loaded 2-core machine."""
SETUP_S = 1.0
"""What setting up a replica's job may add to a step (a loaded machine)."""
START_S = 60.0
"""How long a started rank may take to ask to join (a new process on a loaded machine)."""
EXCHANGES = 4
"""A struck rank is hit before one of its first this many exchanges of the step (each step has more)."""


class Change(StrEnum):
    """A membership strike."""

    KILL = "kill"
    """SIGKILL one rank of a replica at a point of a step."""
    STOP = "stop"
    """SIGSTOP it there; killed before its replica restarts, or at the run's end."""
    ADD = "add"
    """A new replica asks to join before a step."""
    IMPOSTOR = "impostor"
    """A one-rank replica asks to join before a step under the name of a replica that is never struck."""


@dataclass(frozen=True)
class Strike:
    """One membership strike: ``change`` at fleet step ``step`` (KILL, STOP: the step struck; ADD, IMPOSTOR: the
    step they ask before), on replica ``replica`` (its rank ``rank``, at ``point``, before its ``exchange``-th
    exchange), restarted under its name before step ``restart`` (None: never); ADD: a replica of ``size`` ranks."""

    change: Change
    step: int
    replica: str
    rank: int = 0
    point: Point = Point.TRANSFER
    exchange: int = 1
    restart: int | None = None
    size: int = 1

    @property
    def strikes_rank(self) -> bool:
        return self.change in (Change.KILL, Change.STOP)

    def hit(self) -> Hit:
        """What the struck rank's process does to itself."""
        return Hit(self.step, self.point, Action(self.change.value), self.exchange)

    def describe(self) -> str:
        if not self.strikes_rank:
            size = f" ({self.size} ranks)" if self.change is Change.ADD else ""
            return f"{self.change.value} {self.replica}{size} before step {self.step}"
        where = f"{self.point.value}#{self.exchange}" if self.point is Point.TRANSFER else self.point.value
        again = f", restarted before step {self.restart}" if self.restart is not None else ""
        return f"{self.change.value} {self.replica} rank {self.rank} at step {self.step} {where}{again}"


@dataclass(frozen=True)
class Run:
    """One campaign run: ``train`` train ranks, replicas ``r0``... of ``sizes`` ranks, ``steps`` steps in
    ``mode``, each step's deadline ``timeout_s``, and its strikes."""

    index: int
    mode: str
    train: int
    sizes: tuple[int, ...]
    strikes: tuple[Strike, ...]
    timeout_s: float = 4.0
    steps: int = STEPS
    relay: bool = False
    """The trainers feed one replica; it feeds two, and so on (``FleetOptions(direct=1, fanout=2)``)."""

    def describe(self) -> str:
        relay = ", relay tree" if self.relay else ""
        return (f"run {self.index} ({self.mode}, {self.train} train{relay}, replicas {list(self.sizes)}: "
                f"{'; '.join(s.describe() for s in self.strikes)})")

    def settings(self) -> dict[str, Any]:
        """Every rank's options, on top of ``fleet_ranks.options()``."""
        relay = {"fleet": {"direct": 1, "fanout": 2}} if self.relay else {}
        return {"timeout_s": self.timeout_s, "mode": self.mode, "secret": SECRET, **relay}

    def struck(self, replica: str) -> Strike | None:
        """The KILL or STOP strike on ``replica``, if any (at most one per replica)."""
        return next((s for s in self.strikes if s.strikes_rank and s.replica == replica), None)

    def downed(self, started: Started, step: int) -> bool:
        """Whether the replica rank ``started`` was struck (dead or stopped) by step ``step``."""
        strike = self.struck(started.replica)
        return (started.role is Role.INITIAL and strike is not None and strike.rank == started.rank
                and strike.step <= step)

    def stalls(self, step: int, spared: str = "") -> list[Strike]:
        """The rank strikes (but on ``spared``) that may hold step ``step`` up: those in it or in the step before
        (a replica struck after it landed step ``s`` fails step ``s + 1``)."""
        return [s for s in self.strikes if s.strikes_rank and s.replica != spared and step - 1 <= s.step <= step]

    def deadline_s(self, failed: int, joined: int = 0) -> float:
        """How long a step may take in which ``failed`` replicas failed and ``joined`` were set up: ``timeout_s``
        and :data:`SLACK_S`, plus one replica job's deadline (its transfer's, then the commit's) for each that
        failed and :data:`SETUP_S` for each set up (the trainers serve one replica after the other; one that
        lands costs little)."""
        return self.timeout_s + SLACK_S + failed * (self.timeout_s + DECISION_GRACE_S + LINGER_S) + joined * SETUP_S


def _strike(rng: random.Random, change: Change, mode: str, sizes: tuple[int, ...], free: list[str],
            added: int, relay: bool) -> Strike:
    """One random strike of kind ``change``, on a replica of ``free`` (taken from it) where it needs one; in a relay
    tree, a rank strike hits the relay parent ``r0`` half the time (while it is free)."""
    if change is Change.ADD:
        return Strike(change, rng.randint(1, STEPS - 2), f"r{REPLICAS + added}", size=rng.choice([1, 2]))
    parent = relay and change is not Change.IMPOSTOR and "r0" in free and rng.random() < 0.5
    replica = free.pop(free.index("r0") if parent else rng.randrange(len(free)))
    if change is Change.IMPOSTOR:
        return Strike(change, rng.randint(1, STEPS - 1), replica)
    step = rng.randint(1, STEPS - 3)
    points = [Point.TRANSFER, Point.AFTER_VOTE, Point.BETWEEN] + ([Point.AFTER_SETTLE] if mode == "staged" else [])
    points += [Point.FORWARD] * 2 if parent else []
    restart = step + rng.choice([1, 2]) if rng.random() < 0.6 else None
    return Strike(change, step, replica, rng.randrange(sizes[int(replica[1:])]), rng.choice(points),
                  rng.randint(1, EXCHANGES), restart)


def draw(rng: random.Random, index: int, timeout_s: float = 4.0) -> Run:
    """One random run: a mode, 1 or 2 train ranks, :data:`REPLICAS` replicas of 1 or 2 ranks, one strike or two
    (two rank strikes hit two replicas; an impostor takes the name of a replica no strike hits)."""
    mode = rng.choice(["staged", "in_place"])
    sizes = tuple(rng.choice([1, 2]) for _ in range(REPLICAS))
    free = [f"r{i}" for i in range(REPLICAS)]
    changes = sorted(rng.choices(list(Change), k=rng.choice([1, 2])), key=lambda c: c is Change.IMPOSTOR)
    relay = rng.random() < 0.5
    if relay:  # the replicas the tree may join: every rank of one layout (r0 feeds the others)
        sizes = (sizes[0],) * REPLICAS
    strikes, added = [], 0
    for change in changes:
        strikes.append(_strike(rng, change, mode, sizes, free, added, relay))
        added += change is Change.ADD
    return Run(index, mode, rng.choice([1, 2]), sizes, tuple(strikes), timeout_s, relay=relay)


class Role(StrEnum):
    """Why a replica rank was started."""

    INITIAL = "initial"
    RESTART = "restart"
    ADD = "add"
    IMPOSTOR = "impostor"


@dataclass(frozen=True)
class Started:
    """A replica rank as the campaign started it: rank ``rank`` of ``size`` of replica ``replica``, asking to
    join before step ``before``."""

    replica: str
    rank: int
    size: int
    role: Role
    before: int


@dataclass(frozen=True)
class Return:
    """A replica whose every rank asked to join before step ``since`` (each rank ``n`` of ``asks`` for the
    ``asks[n]``-th time): a new one, a restarted one, or one whose ranks join again after it went out."""

    replica: str
    asks: dict[int, int]
    since: int


class Hung(Exception):
    """A rank did not do in time what the run waits for."""


@dataclass
class Record:
    """What one run came to: each step's report by every train rank (``steps[s][r]``), the replica ranks started
    (by harness number), how many times each had asked to join and each replica's newest ranks (by their rank in
    the replica) when each step's gate opened, the returns the campaign waited for, every replica rank's
    :class:`~fleet_ranks.RankLog`, and what hung (None: nothing)."""

    steps: list[list[dict]] = field(default_factory=list)
    started: dict[int, Started] = field(default_factory=dict)
    asks: list[dict[int, int]] = field(default_factory=list)
    ranks: list[dict[str, dict[int, int]]] = field(default_factory=list)
    returns: list[Return] = field(default_factory=list)
    logs: dict[int, list[tuple[str, Any]]] = field(default_factory=dict)
    hung: str | None = None

    def number(self, replica: str, rank: int, role: Role = Role.INITIAL) -> int:
        """The harness number of rank ``rank`` of ``replica`` started as ``role``."""
        return next(n for n, s in self.started.items() if (s.replica, s.rank, s.role) == (replica, rank, role))

    def lead(self, step: int) -> dict:
        """Train rank 0's report of step ``step``."""
        return self.steps[step][0]

    def feeders(self, replica: str, step: int) -> list[str]:
        """The replicas that fed ``replica`` as the last step left them: its feeder, that one's, and so on."""
        feeder = self.lead(step - 1)["feeders"].get(replica) if step else None
        return [] if feeder is None else [feeder, *self.feeders(feeder, step)]

    def went_out(self, replica: str, step: int) -> bool:
        """Whether ``replica`` stopped holding the current version at ``step``: it failed the step, or held the
        last step and is no member of this one."""
        lead = self.lead(step)
        was = step > 0 and replica in self.lead(step - 1)["landed"]
        return replica not in lead["landed"] and (was or replica in lead["failed"])


class Conductor:
    """One run's processes: starts the ranks, opens each step's gate once the replicas expected to join asked,
    and restarts, adds and impersonates replicas between steps (the struck ranks strike themselves)."""

    def __init__(self, run: Run) -> None:
        from refit_core.kit.launch import free_port

        self.run, self.ranks, self.record = run, Ranks(), Record()
        self.folder = tempfile.mkdtemp(prefix="refit-fleet-campaign-")
        self.address = f"127.0.0.1:{free_port()}"
        self._ids = itertools.count(FIRST_ID)
        self._last = FIRST_VERSION + run.steps - 1
        self._current: dict[str, dict[int, int]] = {}
        """Each replica's newest ranks, by their rank in the replica."""
        self._admitted: dict[int, int] = {}
        """Each replica rank's asks when its replica was last admitted."""
        self._pending: dict[str, dict[int, int]] = {}
        """The replicas out or new: the asks each of their live ranks must have made before they are back."""

    def _replica(self, replica: str, rank: int, size: int, role: Role, before: int, hit: Hit | None = None) -> int:
        """Start a replica rank; one that joins after the first step starts ahead and waits (:meth:`_enter`)."""
        number = next(self._ids)
        self.record.started[number] = Started(replica, rank, size, role, before)
        self.ranks.start(fleet_rank, number, self.address, replica, rank, size, self._last, self.run.settings(),
                         self.folder, hit, role is not Role.INITIAL)
        if role is Role.INITIAL:
            self._current.setdefault(replica, {})[rank] = number
        return number

    def _enter(self, number: int) -> None:
        """Let rank ``number``, started ahead, join now."""
        started = self.record.started[number]
        open(start_path(self.folder, number), "w").close()
        if started.role is not Role.IMPOSTOR:
            self._current.setdefault(started.replica, {})[started.rank] = number
            self._pending.setdefault(started.replica, {})[number] = 1

    def _ahead(self) -> dict[Strike, list[int]]:
        """Start the ranks that join later (restarted, added, impostors) ahead: a new process may take seconds on
        a loaded machine, longer than the replicas in the fleet may wait for the next step."""
        ahead: dict[Strike, list[int]] = {}
        for strike in self.run.strikes:
            if strike.restart is not None:
                size = self.run.sizes[int(strike.replica[1:])]
                ahead[strike] = [self._replica(strike.replica, strike.rank, size, Role.RESTART, strike.restart)]
            elif strike.change is Change.ADD:
                ahead[strike] = [self._replica(strike.replica, rank, strike.size, Role.ADD, strike.step)
                                 for rank in range(strike.size)]
            elif strike.change is Change.IMPOSTOR:
                ahead[strike] = [self._replica(strike.replica, 0, 1, Role.IMPOSTOR, strike.step)]
        return ahead

    def asks(self, number: int) -> int:
        """How many times rank ``number`` asked to join, or was refused before it could (an impostor, by the
        fleet's store, while the live replica's rank is connected)."""
        return sum(event in ("asked", "refused") for event, _ in RankLog(self.folder, number).read())

    def _await_asks(self, wanted: dict[int, int], timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.asks(n) < times for n, times in wanted.items()):
            if time.monotonic() > deadline:
                late = {n: self.record.started[n] for n, times in wanted.items() if self.asks(n) < times}
                raise Hung(f"replica ranks {late} did not ask to join within {timeout_s:.0f} s")
            time.sleep(0.02)

    def _changes(self, step: int, ahead: dict[Strike, list[int]]) -> dict[int, int]:
        """The membership changes due before step ``step``; the asks to wait for before its gate (the impostors',
        and those of each replica whose every rank is to ask again: it is back at this step)."""
        wanted: dict[int, int] = {}
        for strike, numbers in ahead.items():
            if self.record.started[numbers[0]].before != step:
                continue
            if strike.restart is not None:  # a stopped rank: killed, as an operator would, before a restart
                self.ranks.kill(self.record.number(strike.replica, strike.rank))
            for number in numbers:
                self._enter(number)
            if strike.change is Change.IMPOSTOR:
                wanted[numbers[0]] = 1
        for replica, asks in list(self._pending.items()):
            if asks.keys() == set(self._current[replica].values()):
                wanted.update(asks)
                self.record.returns.append(Return(replica, asks, step))
                del self._pending[replica]
        return wanted

    def _after(self, step: int) -> None:
        """Note who joined at ``step``, and which replicas went out: their live ranks join again by themselves."""
        record = self.record
        for replica, ranks in self._current.items():
            back = any(r.replica == replica and r.since == step for r in record.returns)
            if back or replica in record.lead(step)["joined"]:
                self._admitted.update({n: record.asks[step][n] for n in ranks.values()})
            if record.went_out(replica, step):
                asks = self._pending.setdefault(replica, {})
                live = [n for n in ranks.values() if not self.run.downed(record.started[n], step)]
                asks.update({n: self._admitted.get(n, 0) + 1 for n in live})

    def conduct(self) -> Record:
        """Run it: the record, its logs read once every rank that can end did."""
        run, record = self.run, self.record
        try:
            for rank in range(run.train):
                self.ranks.start(trainer_rank, rank, self.address, run.train, run.steps, self.folder, run.settings())
            ahead = self._ahead()
            for index, size in enumerate(run.sizes):  # one after the other: the fleet sends to them in this order
                strike = run.struck(f"r{index}")
                for rank in range(size):
                    hit = strike.hit() if strike is not None and strike.rank == rank else None
                    self._replica(f"r{index}", rank, size, Role.INITIAL, 0, hit)
                if not index:
                    self.ranks.release()
                self._await_asks({n: 1 for n in self._current[f"r{index}"].values()})
            for step in range(run.steps):
                self._await_asks(self._changes(step, ahead))
                record.asks.append({n: self.asks(n) for n in record.started})
                record.ranks.append({replica: dict(ranks) for replica, ranks in self._current.items()})
                open(gate(self.folder, step), "w").close()
                wanted = [(rank, "step") for rank in range(run.train)]
                got = self.ranks.wait_for(wanted, run.deadline_s(len(self._current)) + 30)
                record.steps.append([got[w] for w in wanted])
                for w in wanted:
                    del self.ranks.seen[w]
                self._after(step)
            self._await_ends()
        except (Hung, AssertionError) as exc:  # AssertionError: the harness's, a rank late or crashed
            record.hung = str(exc)[:2000]
        finally:
            record.logs = {n: RankLog(self.folder, n).read() for n in record.started}
            self.ranks.close()
            shutil.rmtree(self.folder, ignore_errors=True)
        return record

    def _await_ends(self) -> None:
        """The train ranks' ends, and those of the impostors and of the ranks of the replicas that hold the last
        step (they end there)."""
        landed = self.record.lead(self.run.steps - 1)["landed"]
        ending = [n for replica in landed for n in self._current[replica].values()]
        impostors = [n for n, s in self.record.started.items() if s.role is Role.IMPOSTOR]
        self.ranks.wait_for([(n, "result") for n in [*range(self.run.train), *ending, *impostors]], 30)


def execute(run: Run) -> Record:
    """Run one campaign run (:class:`Conductor`)."""
    return Conductor(run).conduct()


def campaign(runs: int, seed: int, progress=None, *, timeout_s: float = 4.0, workers: int = 1) -> Census:
    """``runs`` random runs from ``seed`` at step deadline ``timeout_s``, ``workers`` at a time (their ranks
    mostly wait: on stopped peers, on gates); ``progress(i, run, census)`` after each, in order."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    plan = [draw(rng, index, timeout_s) for index in range(runs)]
    census = Census()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for run, record in zip(plan, pool.map(execute, plan)):
            census.judge(run, record)
            if progress is not None:
                progress(run.index, run, census)
    return census


__all__ = ["Change", "Conductor", "Record", "Return", "Role", "Run", "Started", "Strike", "campaign", "draw",
           "execute"]
