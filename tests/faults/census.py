"""The census of a fault campaign (``campaign.py``): what the survivors of every run hold and said, judged.

Over all runs it counts, each of which a clean campaign keeps at 0:

- *silent stale sends*: a staged step every train rank reported sent while a surviving gen rank does not
  hold it, or a recovery step reported sent while a gen rank holds other bytes;
- *silent version splits*: an engine whose ranks all survived, which would serve (no rank ``needs_refit``,
  every rank on one version: the rule the vLLM and SGLang plugins apply), while a rank holds other weights
  than that version;
- *unreported torn tensors*: a destination tensor on a surviving gen rank that is neither the version the
  rank reports nor named in its failure's ``torn`` list;
- *cross-job bytes*: a byte of the other job on an engine (two jobs sharing the host: this job's engine
  would hold torn weights; the other job's holds nothing written or its own weights whole: it may set up
  on the port between this job's two setups);
- *late* / *hung*: a survivor whose step (success or error) took longer than its deadline, or that never
  reported;
- *recoveries not bitwise*: after the fault, the job sets up again (new endpoints, a replacement for each
  dead rank) and refits once more: every gen rank must hold that step's weights bitwise, no rank failing;
- *memory faults not named on every rank*: in a run whose strike is a memory fault (one rank's model rebound,
  ``set_()``, resized or freed a tensor before the second step), a rank whose second step succeeded, or
  failed without naming the tensor, its side and what changed;
- *memory faults that moved bytes*: in such a run, a gen rank that left the first step's version, or holds
  other bytes than it: the struck rank never, no rank in staged mode (a piece of a tensor its model freed holds
  nothing to judge). In place, a gen rank that heard of the failure only after the healthy trainers' first
  bytes landed may hold some, reported torn (*unreported torn tensors* checks that); the census counts those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commit_ranks import VERSIONS
from memory_strikes import MemoryStrike
from tally import Tally

COUNTS = ("silent stale sends", "silent version splits", "unreported torn tensors", "cross-job bytes", "late",
          "hung", "recoveries not bitwise", "memory faults not named on every rank", "memory faults that moved bytes")
FREED = "freed"
"""A gen piece's state when its model freed the tensor's storage (``memory_strikes.held``)."""


@dataclass
class Census(Tally):
    """What the campaign found; a clean campaign has no problems."""

    strikes: int = 0
    recoveries: int = 0
    """Runs that set up again after the fault and refitted bitwise."""
    memory: int = 0
    """Judged runs whose strike was a memory fault."""
    memory_named: int = 0
    """Of those, the runs in which every rank's second step failed naming it and every gen rank stayed on the
    first step (the struck one whole; every one, staged)."""

    def judge(self, what: str, mode: str, train: int, gen: int, results: dict[int, dict | None],
              deadlines: dict[int, float], replacements: dict[int, dict | None], intruder: dict | None = None,
              memory: MemoryStrike | None = None) -> None:
        """Add one run: ``results`` maps every rank that was not struck dead to what it reported (None: hung),
        with its ``recovery``; ``deadlines`` each rank's allowed step time; ``replacements`` the recovery
        of each dead rank's replacement (None: it never reported); ``intruder``: the other job's engine's
        report, if any; ``memory``: the run's memory strike, if it had one."""
        self.runs += 1
        hung = [rank for rank, r in results.items() if r is None]
        for rank in hung:
            self.problem("hung", f"{what}: rank {rank} never reported")
        done = {rank: r for rank, r in results.items() if r is not None}
        if intruder is not None and not intruder.get("own_only", False):
            self.problem("cross-job bytes", f"{what}: the other job's engine holds bytes its trainer did not send "
                         f"({intruder})")
        if any(r.get("failed_step") is not None and r["failed_step"] < 1 for r in done.values()):
            self.void += 1
            return
        self._judge_fault(what, mode, train, gen, done, deadlines)
        if memory is not None:
            self._judge_memory(what, memory, mode, gen, done)
        if not hung:
            self._judge_recovery(what, train, {**{r: v.get("recovery") for r, v in done.items()}, **replacements})

    def _judge_fault(self, what: str, mode: str, train: int, gen_size: int, done: dict[int, dict],
                     deadlines: dict[int, float]) -> None:
        for rank, r in done.items():
            if r["seconds"] > deadlines[rank]:
                self.problem("late", f"{what}: rank {rank} took {r['seconds']:.1f} s > {deadlines[rank]:.1f} s")
            self.slowest = max(self.slowest, r["seconds"] / deadlines[rank])
        gen = {rank: {**r, "state": {n: s for n, s in r["state"].items() if s != FREED}}
               for rank, r in done.items() if r["side"] == "gen"}
        for rank, r in gen.items():
            expected = {VERSIONS[0]: "old", VERSIONS[1]: "new"}[r["version"]]
            unreported = [n for n, s in r["state"].items() if s != expected and n not in r.get("torn", [])]
            if unreported:
                self.problem("unreported torn tensors", f"{what}: gen rank {rank - train} holds {unreported} "
                             f"unreported (version {r['version']})")
        senders = [r for r in done.values() if r["side"] == "train"]
        if mode == "staged" and len(senders) == train and all(r["failed_step"] is None for r in senders):
            stale = [rank - train for rank, r in gen.items() if set(r["state"].values()) != {"new"}]
            if stale:
                self.problem("silent stale sends", f"{what}: every train rank sent step 1, gen ranks {stale} "
                             "do not hold it")
        if len(gen) == gen_size:
            serves = not any(r["needs_refit"] for r in gen.values()) and len({r["version"] for r in gen.values()}) == 1
            whole = all(set(r["state"].values()) == {"old" if r["version"] == VERSIONS[0] else "new"}
                        for r in gen.values())
            if serves and not whole:
                self.problem("silent version splits", f"{what}: the engine would serve split or torn weights")
            first = gen[min(gen)]
            self.outcomes["engine serves " + ("new" if serves and first["version"] == VERSIONS[1] else
                                              "old" if serves else "nothing (refit again)")] += 1
        else:
            self.outcomes["engine lost a rank"] += 1

    def _judge_memory(self, what: str, strike: MemoryStrike, mode: str, gen: int, done: dict[int, dict]) -> None:
        """Every rank's second step failed naming the strike's fault; no gen rank left the first step's version,
        the struck one (every one, staged) holds it whole."""
        self.memory += 1
        fault, train = strike.fault(gen), strike.train
        unnamed = {rank: r.get("message", "its step succeeded")[:200] for rank, r in done.items()
                   if r["failed_step"] != 1 or not fault.named_in(r["message"])}
        if unnamed:
            self.problem("memory faults not named on every rank", f"{what}: {unnamed}")
        landed = {rank for rank, r in done.items() if r["side"] == "gen" and set(r["state"].values()) - {"old", FREED}}
        moved = sorted(rank - train for rank, r in done.items() if r["side"] == "gen" and (
            r["version"] != VERSIONS[0] or (rank in landed and (mode == "staged" or rank == strike.rank))))
        if moved:
            self.problem("memory faults that moved bytes", f"{what}: gen ranks {moved} left the first step")
        if landed and not moved:
            self.outcomes["memory fault: healthy trainers' bytes landed in place, reported torn"] += 1
        if not unnamed and not moved and len(done) == train + gen:
            self.memory_named += 1

    def _judge_recovery(self, what: str, train: int, again: dict[int, Any]) -> None:
        failed = {rank: r for rank, r in again.items() if r is None or "error" in r}
        if failed:
            self.problem("recoveries not bitwise", f"{what}: the second setup failed: {failed}")
            return
        torn = [rank - train for rank, r in again.items() if rank >= train and not r["bitwise"]]
        if torn:
            self.problem("recoveries not bitwise", f"{what}: gen ranks {torn} do not hold the recovery step")
            return
        self.recoveries += 1

    def summary(self) -> str:
        judged = self.runs - self.void
        lines = [f"{self.runs} runs ({self.void} void), {self.strikes} strikes, slowest survivor at "
                 f"{self.slowest:.2f} of its deadline, {self.recoveries} of {judged} recoveries bitwise",
                 f"  memory faults named on every rank, every gen rank on the first step: {self.memory_named} of "
                 f"{self.memory}",
                 *self.tail(COUNTS)]
        return "\n".join(lines)


__all__ = ["COUNTS", "Census"]
