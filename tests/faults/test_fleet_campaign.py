"""A few dozen runs of the randomized fleet campaign (``fleet_campaign.py``; ``benchmarks/fleet_campaign.py``
runs hundreds): replica ranks killed or stopped at random points of a step, relay parents among them, restarted
under their name, new replicas added, impostors under live names, with 1 or 2 train ranks, in either mode, fed by
the trainers or through a relay tree; and the three problems the campaign found, each pinned."""

import pytest
from fleet_campaign import SECRET, Change, Run, Strike, campaign, execute
from fleet_census import COUNTS, Census
from fleet_ranks import Point

RUNS = 24
SEED = 49
TIMEOUT_S = 5.0
"""The step deadline: each stopped replica costs the trainers about that much."""
WORKERS = 4
"""Runs at a time: their ranks mostly wait (on gates, on stopped peers)."""
@pytest.mark.slow
def test_a_random_fleet_campaign_keeps_every_replica_current_and_brings_rejoins_back_within_a_step():
    seen = []
    census = campaign(RUNS, SEED, lambda index, run, census: seen.append(run), timeout_s=TIMEOUT_S, workers=WORKERS)
    assert census.runs == RUNS and census.void <= RUNS // 4, census.summary()
    assert not any(census.counts[k] for k in COUNTS), census.summary()
    assert census.rejoins and census.within_one == census.rejoins, census.summary()
    # the draw covers what the campaign is for: each change, each point, both modes, 1 and 2 train ranks,
    # replicas of 1 and 2 ranks, a restart, two strikes in one run, a relay parent struck
    strikes = [s for r in seen for s in r.strikes]
    assert {s.change for s in strikes} == set(Change), seen
    assert {s.point for s in strikes if s.strikes_rank} == set(Point), seen
    assert {r.mode for r in seen} == {"staged", "in_place"} and {r.train for r in seen} == {1, 2}, seen
    assert {size for r in seen for size in r.sizes} == {1, 2}, seen
    assert any(s.restart is not None for s in strikes) and any(len(r.strikes) > 1 for r in seen), seen
    assert any(r.relay and r.struck("r0") is not None for r in seen) and not all(r.relay for r in seen), seen


def judged(run: Run) -> Census:
    census = Census()
    census.judge(run, execute(run))
    return census


@pytest.mark.slow
def test_a_replica_stopped_first_in_the_fanout_fails_that_step_alone():
    """r0 (first in the fanout) stopped inside its transfer of step 1: r1 and r2 land every step. Before, a
    replica's deadline counted from its receive(), not from when the trainers reached it (one replica after the
    other): a replica stopped ahead failed every replica behind it."""
    census = judged(Run(0, "in_place", 1, (1, 1, 1), (Strike(Change.STOP, 1, "r0", 0, Point.TRANSFER, 1),),
                        TIMEOUT_S))
    assert not census.problems, census.summary()


@pytest.mark.slow
def test_train_ranks_judge_a_replica_killed_after_its_staged_vote_alike():
    """Staged, 2 train ranks: r2 killed right after its vote of step 1; both train ranks report it alike (before,
    train rank 0 failed it, never settled, and train rank 1 landed it, having read the commit decision)."""
    census = judged(Run(0, "staged", 2, (1, 1, 1), (Strike(Change.KILL, 1, "r2", 0, Point.AFTER_VOTE),), TIMEOUT_S))
    assert not census.problems, census.summary()


@pytest.mark.slow
def test_a_joiner_that_dies_between_its_ticket_and_its_request_blocks_no_later_join():
    """A rank draws a join ticket and leaves before step 1; replica r1 asks before step 1: it joins then (before,
    train rank 0 read the tickets in order and waited for the dead one's request at every step)."""
    import shutil
    import tempfile
    import time

    from fleet_ranks import FIRST_VERSION, RankLog, fleet_rank, gate, options, trainer_rank
    from harness import Ranks

    from refit_core.contract.env import with_overrides
    from refit_core.fleet.records import JOINS
    from refit_core.kit.launch import free_port
    from refit_core.net.auth import JobCredentials
    from refit_core.net.rendezvous import Rendezvous

    folder, address = tempfile.mkdtemp(), f"127.0.0.1:{free_port()}"
    settings = {"timeout_s": TIMEOUT_S, "secret": SECRET}
    ranks, steps = Ranks(), []

    def ask(number: int, replica: str) -> None:
        ranks.start(fleet_rank, number, address, replica, 0, 1, FIRST_VERSION + 2, settings, folder, None)
        while not any(event == "asked" for event, _ in RankLog(folder, number).read()):
            time.sleep(0.02)
    try:
        ranks.start(trainer_rank, 0, address, 1, 3, folder, settings)
        ranks.release()
        ask(10, "r0")
        for step in range(3):
            if step == 1:
                ghost = Rendezvous(address, host=False, who="replica/ghost/0", timeout_s=TIMEOUT_S,
                                   credentials=JobCredentials.required(with_overrides(options(**settings)), "ghost"))
                ghost.client.add(JOINS, 1)
                ghost.close()
                ask(11, "r1")
            open(gate(folder, step), "w").close()
            steps.append(ranks.wait_for([(0, "step")], 60)[(0, "step")])
            del ranks.seen[(0, "step")]
    finally:
        ranks.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert [s["landed"] for s in steps] == [["r0"], ["r0", "r1"], ["r0", "r1"]], steps
