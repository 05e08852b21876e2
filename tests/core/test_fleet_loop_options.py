"""``refit demo --loop --replicas N --chaos [STEP]`` (issue #49): its options and its table, without Ray or an
engine (the loop itself runs 3 vLLM engines: minutes of CPU, out of CI's budget)."""

from __future__ import annotations

import dataclasses

import pytest

from refit_core import RefitError
from refit_core.kit.rl import LogprobMismatch
from refit_core.tools.cli import build_parser, main
from refit_core.tools.demo.command import loop_settings
from refit_core.tools.demo.fleet_loop import FleetResult, FleetRow, ProbeCheck, fleet_header, fleet_line
from refit_core.tools.demo.rl_loop import LoopSettings, StepRow


def settings(*flags: str) -> LoopSettings:
    return loop_settings(build_parser().parse_args(["demo", "--loop", *flags]))


def test_the_default_loop_has_one_engine_and_no_chaos() -> None:
    given = settings()
    assert (given.replicas, given.chaos_step) == (1, None) == (LoopSettings.replicas, LoopSettings.chaos_step)


def test_chaos_strikes_at_the_step_given_or_mid_run() -> None:
    assert (settings("--replicas", "3", "--chaos", "2", "--steps", "5").chaos_step) == 2
    assert settings("--replicas", "3", "--chaos").chaos_step == LoopSettings.steps // 2
    assert settings("--replicas", "3", "--chaos", "--steps", "5").replicas == 3


@pytest.mark.parametrize(("flags", "refusal"), [
    (("--chaos",), "use --replicas 2 or more"),
    (("--replicas", "3", "--chaos", "5", "--steps", "5"), r"must lie in 1\.\.4"),
    (("--replicas", "3", "--chaos", "0"), r"must lie in 1\.\.19"),
    (("--replicas", "0",), "at least 1"),
])
def test_chaos_that_leaves_no_step_or_no_replica_is_refused(flags: tuple[str, ...], refusal: str) -> None:
    with pytest.raises(RefitError, match=refusal):
        settings(*flags)


def test_replicas_without_the_loop_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--replicas", "3"]) == 2
    assert "--replicas and --chaos go with --loop" in capsys.readouterr().err


def fleet_row(step: int, holders: tuple[str, ...], equal: bool = True, kl: float = 0.0) -> FleetRow:
    row = StepRow(step, 0.2, LogprobMismatch(1e-12, 1e-6, 512), 0.01, 900.0, 400.0, 0, str(step))
    return FleetRow(row, holders, tuple(ProbeCheck(n, equal, LogprobMismatch(kl, 0.0, 16)) for n in holders))


def test_the_table_shows_which_replicas_hold_each_version() -> None:
    names = ("r0", "r1", "r2")
    header = fleet_header(names)
    killed = dataclasses.replace(fleet_row(2, ("r0", "r1")), events=("r2 killed at step 2, restarting",))
    line = fleet_line(killed, names)
    assert line.index("r0 r1 --") == header.index("holding")
    assert line.endswith("  2/2   0.0e+00  r2 killed at step 2, restarting"), line
    assert fleet_line(fleet_row(3, names), names).endswith("r0 r1 r2    3/3   0.0e+00")  # no events: no blanks


def test_the_fleet_verdict_needs_every_holder_checked_equal_within_the_bound() -> None:
    def result(*rows: FleetRow) -> FleetResult:
        return FleetResult(rows=[r.row for r in rows], kl_bound=1e-3, replicas=("r0", "r1"), fleet_rows=list(rows))

    assert result(fleet_row(1, ("r0", "r1")), fleet_row(2, ("r0",))).ok
    assert not result(fleet_row(1, ("r0", "r1"), equal=False)).ok  # a greedy generation differs from HF's
    assert not result(fleet_row(1, ("r0", "r1"), kl=1e-2)).ok  # log-probabilities off: weights wrong
    assert not result(fleet_row(1, ())).ok  # no replica holds the version
