"""A few dozen runs of the randomized fault campaign (``campaign.py``; ``benchmarks/fault_campaign.py`` runs
hundreds): a rank killed, stopped or paused at a random point of a step, in either mode."""

import pytest
from campaign import Action, Point, campaign

RUNS = 24
SEED = 26


@pytest.mark.slow
def test_a_random_fault_campaign_finds_no_unreported_tear_no_split_engine_serving_and_no_late_survivor():
    seen = []
    census = campaign(RUNS, SEED, lambda index, run, census: seen.append(run))
    assert census.runs == RUNS and census.void <= RUNS // 4, census.summary()
    assert not census.problems, census.summary()
    # the draw covers what the campaign is for: each action, each commit point, both modes
    assert {r.strike.action for r in seen} == set(Action), seen
    assert {r.strike.point for r in seen} == set(Point), seen
    assert {r.mode for r in seen} == {"staged", "in_place"}, seen
