"""Outcomes of conformance checks, and the error a failed suite raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum


class Outcome(Enum):
    """How one check ended."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class CheckResult:
    """One check: what it checked, how it ended, and every problem it found (empty when passed)."""

    name: str
    outcome: Outcome
    problems: tuple[str, ...] = ()
    note: str = ""

    def line(self) -> str:
        head = f"{self.outcome.value.upper():7} {self.name}" + (f" ({self.note})" if self.note else "")
        return "\n".join([head, *(f"        - {p}" for p in self.problems[:20]),
                          *([f"        - ... and {len(self.problems) - 20} more"] if len(self.problems) > 20 else [])])


class ConformanceError(AssertionError):
    """A backend failed conformance checks; the message lists every failed check and its problems."""

    def __init__(self, results: Sequence[CheckResult]) -> None:
        self.results = tuple(results)
        failed = [r for r in results if r.outcome is Outcome.FAILED]
        super().__init__(f"{len(failed)} conformance check(s) failed:\n" + "\n".join(r.line() for r in failed))


def run_check(name: str, check: Callable[[], list[str]], note: str = "") -> CheckResult:
    """Run ``check`` (returning problems); an exception it raises is a problem too, named by type."""
    try:
        problems = check()
    except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check, reported by name
        problems = [f"raised {type(exc).__name__}: {exc}"]
    return CheckResult(name, Outcome.FAILED if problems else Outcome.PASSED, tuple(problems), note)


def require(results: Sequence[CheckResult]) -> list[CheckResult]:
    """Raise :class:`ConformanceError` if any result failed; return them otherwise."""
    if any(r.outcome is Outcome.FAILED for r in results):
        raise ConformanceError(results)
    return list(results)
