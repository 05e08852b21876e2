"""What both randomized campaigns' censuses keep (``census.py``, ``fleet_census.py``): runs, void runs, the
outcomes seen, and each problem by kind; a clean campaign has no problems."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Tally:
    """Runs judged so far, the outcomes seen and the problems found (each counted under its kind)."""

    runs: int = 0
    void: int = 0
    """Runs in which the strike could not be judged (a step before it failed: a loaded machine)."""
    outcomes: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    slowest: float = 0.0
    """The slowest step, as a fraction of its deadline."""

    def problem(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        self.problems.append(f"{kind}: {text}")

    def tail(self, kinds: tuple[str, ...]) -> list[str]:
        """The summary's last lines: every outcome, each kind of problem's count (``kinds``, 0s included: a
        clean campaign shows them), and every problem."""
        return [*(f"  {k}: {v}" for k, v in sorted(self.outcomes.items())),
                *(f"  {k}: {self.counts[k]}" for k in kinds),
                f"  problems: {len(self.problems)}", *(f"    {p}" for p in self.problems)]


__all__ = ["Tally"]
