"""The census of a fleet campaign (``fleet_campaign.py``): what each run's train ranks reported step by step and
its replica ranks logged, judged. Over all runs it counts, each of which a clean campaign keeps at 0:

- *silent stale*: a replica that the train ranks report landed a step while one of its live ranks does not
  hold that version bitwise, or that is reported landed though one of its ranks was struck inside the transfer;
- *not bitwise*: a version a replica rank holds (its ``receive()`` returned) that is not bitwise the trainers';
- *train ranks disagree*: two train ranks that judge a step's replicas differently (landed, failed);
- *late* / *hung*: a step past its deadline (``Run.deadline_s``: a replica job's deadline per failed replica),
  or a run in which a rank did not ask to join, report a step or end in time, or crashed;
- *survivors hit*: a replica that stops holding the current version (fails a step, or is dropped) though no
  strike hit it then, nor its feeder (or a feeder above it) at that step; *survivors hit behind a struck
  replica*: the same, its ranks (or its setup) past their deadline while the trainers waited on a replica struck
  in that step (or the one before); *survivors past their deadline, no strike*: the same without a strike (the
  trainers were slow to reach it: a loaded machine);
- *dead replicas kept*: a replica landed after it went out without joining again, failed twice in a row, or
  struck and still landed the step after its strike;
- *rejoins late*: a replica whose every rank asked to join before step ``g`` (restarted, added, or joining
  again after a failed step), not back on the current version at step ``g`` or ``g + 1``;
- *impostors admitted*: a replica asking to join under a live replica's name, not refused by that name (by train
  rank 0, or by the fleet's store while that rank of the replica is connected to it: a replica's ranks stay
  connected while they serve).

It counts too the rejoins back on the current version at once, and within a step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleet_ranks import FIRST_VERSION, Point
from tally import Tally

if TYPE_CHECKING:
    from fleet_campaign import Record, Return, Run, Strike

BEHIND = "survivors hit behind a struck replica"
SLOW = "survivors past their deadline, no strike"
COUNTS = ("silent stale", "not bitwise", "train ranks disagree", "late", "hung", "survivors hit", BEHIND, SLOW,
          "dead replicas kept", "rejoins late", "impostors admitted")
PAST_DEADLINE = ("did not complete within", "timed out")
"""How a replica's ranks say they gave up on a step (or on its setup) at its deadline."""


@dataclass(frozen=True)
class Timeline:
    """One replica's steps, as train rank 0 reported them."""

    name: str
    record: Record

    def landed(self, step: int) -> bool:
        return 0 <= step < len(self.record.steps) and self.name in self.record.lead(step)["landed"]

    def failed(self, step: int) -> bool:
        return 0 <= step < len(self.record.steps) and self.name in self.record.lead(step)["failed"]

    def joined(self, step: int) -> bool:
        return self.name in self.record.lead(step)["joined"]

    def reason(self, step: int) -> str:
        return self.record.lead(step)["failed"].get(self.name, "absent")


@dataclass
class Census(Tally):
    """What the fleet campaign found; a clean campaign has no problems."""

    strikes: Counter = field(default_factory=Counter)
    rejoins: int = 0
    """Replicas whose every rank asked to join before a step of the run (restarted, added, joining again)."""
    at_once: int = 0
    """Of those, the replicas back on the current version at that step."""
    within_one: int = 0
    """Of those, the replicas back on the current version at that step or the next."""

    def judge(self, run: Run, record: Record) -> None:
        """Add one run."""
        from fleet_campaign import Role

        self.runs += 1
        what = run.describe()
        self.strikes.update(s.change.value for s in run.strikes)
        self.strikes.update("restart" for s in run.strikes if s.restart is not None)
        if record.hung is not None:
            self.problem("hung", f"{what}: {record.hung}")
            return
        fired = {s: ("struck", s.step) in record.logs[record.number(s.replica, s.rank)]
                 for s in run.strikes if s.strikes_rank}
        if not all(fired.values()):
            self.void += 1
            return
        self._judge_steps(what, run, record)
        for number, log in record.logs.items():
            torn = [value for event, value in log if event == "held" and not value[1]]
            if torn:
                self.problem("not bitwise", f"{what}: replica rank {record.started[number]} holds versions {torn}")
        for name in sorted({s.replica for s in record.started.values() if s.role is not Role.IMPOSTOR}):
            self._judge_replica(what, run, record, Timeline(name, record))
        for back in record.returns:
            self._judge_return(what, record, back)
        self._judge_impostors(what, record)

    def _judge_steps(self, what: str, run: Run, record: Record) -> None:
        """Every train rank judges each step's replicas alike, within the step's deadline."""
        for step, reports in enumerate(record.steps):
            views = {(tuple(sorted(r["landed"])), tuple(sorted(r["failed"]))) for r in reports}
            if len(views) > 1:
                self.problem("train ranks disagree", f"{what}: step {step}: {reports}")
            deadline = run.deadline_s(len(reports[0]["failed"]), len(reports[0]["joined"]))
            for rank, report in enumerate(reports):
                if report["seconds"] > deadline:
                    self.problem("late", f"{what}: train rank {rank}, step {step}: {report['seconds']:.1f} s > "
                                 f"{deadline:.1f} s")
                self.slowest = max(self.slowest, report["seconds"] / deadline)

    def _judge_replica(self, what: str, run: Run, record: Record, line: Timeline) -> None:
        """When it went out, and why; never landed without joining after that; every landed step held bitwise by
        every live rank."""
        strike, name = run.struck(line.name), line.name
        if strike is not None:
            self._judge_struck(what, strike, line)
        returns = {r.since for r in record.returns if r.replica == name}
        for step in range(len(record.steps)):
            if (record.went_out(name, step) and not (strike is not None and strike.step <= step <= strike.step + 1)
                    and not self._lost_feed(run, record, name, step)):
                why = " / ".join([line.reason(step), *self._rank_failures(record, name, step)])
                late = any(p in why for p in PAST_DEADLINE)
                kind = "survivors hit" if not late else BEHIND if run.stalls(step, spared=name) else SLOW
                self.problem(kind, f"{what}: {name} went out at step {step}: {why[:400]}")
            if line.landed(step) and step and not line.landed(step - 1) and not line.joined(step):
                self.problem("dead replicas kept", f"{what}: {name} landed step {step} without joining again")
            if line.failed(step) and line.failed(step - 1) and step not in returns:
                self.problem("dead replicas kept", f"{what}: {name} failed steps {step - 1} and {step}")
            if line.landed(step):
                self._judge_held(what, run, record, name, step)

    @staticmethod
    def _lost_feed(run: Run, record: Record, name: str, step: int) -> bool:
        """Whether a feeder above ``name`` went out at ``step``, or was struck then or in the step before."""
        return any(record.went_out(feeder, step) or any(s.step <= step <= s.step + 1 for s in run.strikes
                                                         if s.strikes_rank and s.replica == feeder)
                   for feeder in record.feeders(name, step))

    @staticmethod
    def _rank_failures(record: Record, name: str, step: int) -> list[str]:
        """What the ranks of ``name`` noted as their first failure after they held the step before ``step``
        (a rank that gave up on its own, idle past its deadline, closes its end: the trainers see a peer leave)."""
        held = ["held", [FIRST_VERSION + step - 1, True]]
        failures = []
        for n in record.ranks[step].get(name, {}).values():
            log = [list(e) for e in record.logs[n]]
            start = log.index(held) if held in log else 0
            failures += [str(v) for e, v in log[start:] if e == "failed"][:1]
        return failures

    def _judge_held(self, what: str, run: Run, record: Record, name: str, step: int) -> None:
        live = [n for n in record.ranks[step][name].values() if not run.downed(record.started[n], step)]
        held = ["held", [FIRST_VERSION + step, True]]
        stale = [record.started[n].rank for n in live if held not in [list(e) for e in record.logs[n]]]
        if stale:
            self.problem("silent stale", f"{what}: {name} landed step {step}, its ranks {stale} do not hold it "
                         "bitwise")

    def _judge_struck(self, what: str, strike: Strike, line: Timeline) -> None:
        """The struck replica: failed at its strike's step if struck inside the transfer; out by the next."""
        s = strike.step
        at = "landed" if line.landed(s) else "failed" if line.failed(s) else "absent"
        then = "back" if line.joined(s + 1) else "failed" if line.failed(s + 1) else "dropped"
        self.outcomes[f"{strike.change.value} at {strike.point.value}: {at} that step, then {then}"] += 1
        if strike.point is Point.TRANSFER and line.landed(s):
            self.problem("silent stale", f"{what}: {line.name} reported landed at step {s}, struck inside it")
        if line.landed(s + 1) and not line.joined(s + 1):
            self.problem("dead replicas kept", f"{what}: {line.name} struck at step {s} landed step {s + 1}")

    def _judge_return(self, what: str, record: Record, back: Return) -> None:
        """A replica whose every rank asked before step ``back.since``: back on the current version at that step
        or the next."""
        from fleet_campaign import Role

        roles = {record.started[n].role for n in back.asks}
        kind = "restart" if Role.RESTART in roles else "add" if Role.ADD in roles else "rejoin after a failed step"
        line, since = Timeline(back.replica, record), back.since
        self.rejoins += 1
        if line.landed(since):
            self.at_once += 1
            self.outcomes[f"{kind}: back at once"] += 1
        elif line.landed(since + 1):
            self.outcomes[f"{kind}: back the step after"] += 1
        elif since + 1 < len(record.steps):
            self.problem("rejoins late", f"{what}: {back.replica} asked before step {since}, not back by the next")
            return
        else:
            self.outcomes[f"{kind}: asked before the last step, not back"] += 1
            return
        self.within_one += 1

    def _judge_impostors(self, what: str, record: Record) -> None:
        from fleet_campaign import Role

        for number, started in record.started.items():
            if started.role is not Role.IMPOSTOR:
                continue
            refused = [str(v) for e, v in record.logs[number] if e == "refused"]
            if any(f"replica {started.replica} is already in the fleet" in r for r in refused):
                self.outcomes["impostor refused by name"] += 1
            elif any(f"replica/{started.replica}/0 is already connected" in r for r in refused):
                self.outcomes["impostor refused by the store (that rank of the replica connected)"] += 1
            else:
                self.problem("impostors admitted", f"{what}: an impostor of {started.replica}: {refused}")

    def summary(self) -> str:
        strikes = ", ".join(f"{v} {k}" for k, v in sorted(self.strikes.items()))
        lines = [f"{self.runs} runs ({self.void} void), strikes: {strikes}; slowest step at {self.slowest:.2f} of "
                 "its deadline",
                 f"  rejoins (restarted, added, or joining again): {self.rejoins}, back on the current version at "
                 f"once: {self.at_once}, within 1 step: {self.within_one}",
                 *self.tail(COUNTS)]
        return "\n".join(lines)


__all__ = ["BEHIND", "COUNTS", "SLOW", "Census", "Timeline"]
