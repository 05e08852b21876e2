"""A few dozen runs of the randomized fault campaign (``campaign.py``; ``benchmarks/fault_campaign.py`` runs
hundreds): one or two ranks killed, stopped, paused or stalled past the deadline at random points of a step,
in either mode, sometimes with a second job on the same port; in some runs instead, one rank's model rebinds,
``set_()``s, resizes or frees a tensor's memory before the step; then the job sets up again and refits."""

import pytest
from campaign import Action, Point, campaign
from census import COUNTS
from memory_faults import Change

from refit_core import Side

RUNS = 20
SEED = 47
TIMEOUT_S = 2.0
"""The step deadline: each stopped rank costs the survivors about that much."""
WORKERS = 4
"""Runs at a time: their ranks mostly wait (on deadlines, pauses, stopped peers)."""


@pytest.mark.slow
def test_a_random_fault_campaign_finds_no_unreported_tear_no_split_engine_serving_and_no_late_survivor():
    seen = []
    census = campaign(RUNS, SEED, lambda index, run, census: seen.append(run), timeout_s=TIMEOUT_S, workers=WORKERS)
    assert census.runs == RUNS and census.void <= RUNS // 4, census.summary()
    assert not census.problems and not any(census.counts[k] for k in COUNTS), census.summary()
    assert census.recoveries == RUNS - census.void, census.summary()  # every judged run recovered bitwise
    memory = [r.memory for r in seen if r.memory is not None]
    assert census.memory_named == census.memory >= len(memory) - census.void, census.summary()
    # the draw covers what the campaign is for: each action, each commit point, both modes, two strikes in
    # one run, a second job on the host; each memory change, on either side, with and without the plugin
    # listing the model's tensors
    strikes = [s for r in seen for s in r.strikes]
    assert {s.action for s in strikes} == set(Action), seen
    assert {s.point for s in strikes} == set(Point), seen
    assert {r.mode for r in seen} == {"staged", "in_place"}, seen
    assert any(len(r.strikes) > 1 for r in seen) and any(r.two_jobs for r in seen), seen
    assert {m.change for m in memory} == set(Change) and {m.side for m in memory} == set(Side), memory
    assert {m.lists for m in memory} == {True, False}, memory
