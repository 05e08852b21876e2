"""The commit point, real processes over gloo: every gen rank votes, train rank 0 decides, every rank applies
the decision it read; a rank that cannot read it refuses to serve; every error is true and in time."""

import re

import pytest
from commit_ranks import VERSIONS, CommitScenario, Trick, commit_rank
from harness import Ranks

from refit_core.kit.launch import free_port

TRAIN, GEN = 2, 2
OLD, NEW = VERSIONS


def run(scenario: CommitScenario, survivors: list[int] | None = None) -> dict[int, dict]:
    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    everyone = list(range(scenario.train + scenario.gen))
    try:
        for rank in everyone:
            ranks.start(commit_rank, rank, address, scenario)
        ranks.release()
        wanted = everyone if survivors is None else survivors
        results = ranks.wait_for([(r, "result") for r in wanted], timeout_s=120)
        return {rank: results[(rank, "result")] for rank in wanted}
    finally:
        ranks.close()


def engine_serves(gen: list[dict]) -> bool:
    """The rule the engine plugins apply: an engine serves only while no rank needs a refit and every rank
    holds the same version."""
    return not any(r["needs_refit"] for r in gen) and len({r["version"] for r in gen}) == 1


def gen_results(results: dict[int, dict], train: int = TRAIN) -> list[dict]:
    return [results[r] for r in sorted(results) if r >= train]


@pytest.mark.slow
@pytest.mark.parametrize("exits", [False, True], ids=["closes", "exits-right-after-send"])
def test_an_engine_rank_descheduled_after_its_vote_still_lands_the_version_its_peers_landed(exits):
    """Gen rank 1 sleeps 2 s after voting; the trainer then closes normally, or exits without close():
    train rank 0's send() waits until gen rank 1 read the decision, so both gen ranks hold the new version
    and nobody raises (before: gen rank 1 raised a false "not applied on any gen rank")."""
    tricks = ((TRAIN + 1, Trick.PAUSE_AFTER_VOTE),) + (((0, Trick.EXIT_AFTER_SEND),) if exits else ())
    scenario = CommitScenario(TRAIN, GEN, "staged", tricks)
    results = run(scenario, survivors=None if not exits else [1, 2, 3])
    for rank, r in results.items():
        assert "error" not in r, (rank, r)
    gen = gen_results(results)
    for r in gen:
        assert r["version"] == NEW and set(r["state"].values()) == {"new"} and not r["needs_refit"], r
    assert gen[1]["seconds"] >= 2.0  # the pause really happened inside the step


@pytest.mark.slow
def test_a_train_rank_descheduled_before_reading_the_decision_still_learns_it():
    """Train rank 1 sleeps 2 s before reading the decision on step 1 while train rank 0 returns and closes:
    train rank 0's close() keeps the store up until train rank 1 read it, so every rank succeeds (before:
    train rank 1 raised "could not learn train rank 0's decision", the store gone)."""
    results = run(CommitScenario(TRAIN, GEN, "staged", ((1, Trick.READ_DECISION_LATE),)))
    for rank, r in results.items():
        assert "error" not in r, (rank, r)
    assert results[1]["seconds"] >= 2.0  # the pause really happened inside the step
    assert all(r["version"] == NEW for r in gen_results(results))


@pytest.mark.slow
def test_a_rank_that_cannot_learn_the_decision_keeps_its_weights_refuses_to_serve_and_says_why():
    """Train rank 0 dies half a second after deciding; gen rank 1 was descheduled and never read the
    decision. Gen rank 0 applied it; gen rank 1 keeps the old version, marks itself needs_refit, and its
    error says it could not learn the decision; the engine does not serve split weights."""
    tricks = ((0, Trick.DIE_AFTER_DECIDING), (TRAIN + 1, Trick.PAUSE_AFTER_VOTE))
    scenario = CommitScenario(TRAIN, GEN, "staged", tricks)
    results = run(scenario, survivors=[1, 2, 3])
    gen0, gen1 = gen_results(results)
    assert "error" not in gen0 and gen0["version"] == NEW and set(gen0["state"].values()) == {"new"}, gen0
    assert gen1["error"] == "StepFailedError" and "could not learn train rank 0's decision" in gen1["message"], gen1
    assert "refuses to serve" in gen1["message"], gen1["message"]
    assert gen1["version"] == OLD and set(gen1["state"].values()) == {"old"} and gen1["needs_refit"], gen1
    assert not engine_serves([gen0, gen1])
    deadline = scenario.timeout_s + min(scenario.timeout_s, 2.0) + 2.0  # the decision's wait, the pause
    assert gen1["seconds"] < deadline + 3, gen1


@pytest.mark.slow
def test_the_surviving_sender_learns_that_the_step_did_not_land():
    """In place with ``confirm=True``, train rank 1 is killed mid-step: every gen rank fails, and train rank
    0's send() raises naming a gen rank's failure (before: it returned success)."""
    import signal

    from fault_ranks import Fault, Scenario
    from test_transfer_faults import run as run_faulty

    results = run_faulty(Scenario(TRAIN, GEN, {"mode": "in_place", "timeout_s": 8, "confirm": True},
                                  Fault(1, signal.SIGKILL)))
    survivor = results[0]
    assert survivor.get("error") == "TransferError", survivor
    # Which news reaches it first is a race: a gen rank's abort during the transfer, or the commit vote.
    assert re.search(r"gen rank \d+ (did not land step 1|did not vote on step 1|gave up on the step first)",
                     survivor["message"]), survivor


@pytest.mark.slow
@pytest.mark.parametrize("trick,rank,name", [
    (Trick.REPLACE_SOURCE, 0, "source tensor model.embed_tokens.weight"),
    (Trick.REPLACE_DESTINATION, TRAIN, "destination tensor model.norm.weight"),
], ids=["source", "destination"])
def test_weights_replaced_after_setup_are_named_instead_of_sent_stale(trick, rank, name):
    """On the network path a parameter replaced after setup used to be sent stale (or landed in the
    replaced tensor) without an error; now the step fails on that rank, naming the tensor, before any byte
    moves, and no gen rank applies the step."""
    results = run(CommitScenario(TRAIN, GEN, "staged", ((rank, trick),)))
    culprit = results[rank]
    assert "error" in culprit and name in culprit["message"], culprit
    assert "now lives at a different address" in culprit["message"], culprit
    for r in gen_results(results):
        # the trick itself zeroed the culprit's norm
        held = {n: s for n, s in r["state"].items() if r is not culprit or n != "model.norm.weight"}
        assert "error" in r and r["version"] == OLD and set(held.values()) == {"old"}, r


@pytest.mark.slow
def test_a_source_replaced_after_setup_fails_an_in_place_step_before_any_byte_moves():
    """In place, on the network path, train rank 0 replaced a parameter: it fails naming it before its
    step's headers leave, so every gen rank fails within the deadline with its weights unchanged (train
    rank 1's bytes never moved: the gen ranks post nothing before every train rank's header arrived)."""
    scenario = CommitScenario(TRAIN, GEN, "in_place", ((0, Trick.REPLACE_SOURCE),))
    results = run(scenario)
    culprit = results[0]
    assert "source tensor model.embed_tokens.weight now lives at a different address" in culprit["message"], culprit
    gen = gen_results(results)
    for r in gen:
        assert "error" in r and r["seconds"] < scenario.timeout_s + 3, r
        assert r["version"] == OLD and not r["needs_refit"] and set(r["state"].values()) == {"old"}, r
    assert engine_serves(gen)


@pytest.mark.slow
def test_an_engine_rank_failing_its_own_checks_at_setup_reaches_the_trainer_at_once_with_its_text():
    """Before: train rank 0 waited its whole deadline for the gen side's size (the failing rank never
    published it) before raising."""
    from commit_ranks import unrecognized_engine_rank
    from fault_ranks import setup_rank

    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        ranks.start(setup_rank, 0, address, 1, 1, {"timeout_s": 30})
        ranks.start(unrecognized_engine_rank, 1, address, 1, 1, {"timeout_s": 30})
        ranks.release()
        results = ranks.wait_for([(0, "result"), (1, "result")], timeout_s=120)
    finally:
        ranks.close()
    trainer, engine = results[(0, "result")], results[(1, "result")]
    assert engine["error"] == "PluginError" and "no installed refit plugin recognizes" in engine["message"], engine
    assert trainer["error"] == "PluginError" and f"gen rank 0: {engine['message']}" in trainer["message"], trainer
    assert trainer["seconds"] < 10, trainer  # its deadline is 30 s


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_the_store_forgets_old_steps_commit_keys(mode):
    """Every step writes a vote (and, staged, a settlement) per gen rank and, staged, one decision; train rank
    0 deletes old steps' keys every FORGET_EVERY steps, so a long run holds a bounded number of keys."""
    from commit_ranks import many_steps_rank

    from refit_core.endpoints.commit import FORGET_EVERY, KEPT_STEPS

    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    steps = KEPT_STEPS + 2 * FORGET_EVERY
    try:
        for r in range(3):
            ranks.start(many_steps_rank, r, address, 1, 2,
                        {"timeout_s": 30, "mode": mode, "confirm": True, "steps": steps})
        ranks.release()
        results = ranks.wait_for([(r, "result") for r in range(3)], timeout_s=120)
    finally:
        ranks.close()
    held = results[(0, "result")]["held"]
    first, second = KEPT_STEPS + FORGET_EVERY - 1, KEPT_STEPS + 2 * FORGET_EVERY - 1  # right after each deletion
    assert held[first] < held[first - 1] and held[second] == held[first], held
    assert held[first - 1] == held[second - 1] == max(held), held  # never more than before a deletion
