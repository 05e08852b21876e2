"""A rank killed (SIGKILL) or stopped (SIGSTOP) in the middle of a step's transfer, real processes
over gloo: in staged mode no destination byte changes; in place, every tensor that changed is
reported torn, the engine's version stays, and it refuses to serve; nobody waits past the deadline."""

import signal
import time

import pytest
from fault_ranks import Fault, Scenario, replacement_rank, run_rank
from harness import Ranks

from refit_core.kit.launch import free_port

TRAIN, GEN = 2, 2
STEP_TIMEOUT_S = 8
"""The deadline of a step whose rank is stopped: the survivors must wait it out (twice at most)."""
KILLED_TIMEOUT_S = 30
"""The deadline of a step whose rank is killed: a closed connection is seen at once, so every survivor
ends in under half of it (a loaded 2-core box keeps that margin; an 8 s deadline did not)."""


def run(scenario: Scenario) -> dict[int, dict]:
    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    try:
        for rank in range(scenario.train + scenario.gen):
            ranks.start(run_rank, rank, address, scenario)
        ranks.release()
        survivors = [r for r in range(scenario.train + scenario.gen) if r != scenario.fault.rank]
        results = ranks.wait_for([(r, "result") for r in survivors], timeout_s=180)
        return {rank: results[(rank, "result")] for rank in survivors}
    finally:
        ranks.close()


CASES = [  # (who, signal, mode)
    ("sender", signal.SIGKILL, "staged"), ("sender", signal.SIGKILL, "in_place"),
    ("sender", signal.SIGSTOP, "staged"), ("sender", signal.SIGSTOP, "in_place"),
    ("receiver", signal.SIGKILL, "staged"), ("receiver", signal.SIGKILL, "in_place"),
    ("receiver", signal.SIGSTOP, "staged"), ("receiver", signal.SIGSTOP, "in_place"),
]


@pytest.mark.slow
@pytest.mark.parametrize("who,sig,mode", CASES, ids=[f"{w}-{s.name}-{m}" for w, s, m in CASES])
def test_a_rank_lost_mid_transfer_leaves_old_weights_or_reported_torn_ones(who, sig, mode):
    victim = 1 if who == "sender" else TRAIN + 1
    deadline = KILLED_TIMEOUT_S if sig == signal.SIGKILL else STEP_TIMEOUT_S
    results = run(Scenario(TRAIN, GEN, {"mode": mode, "timeout_s": deadline}, Fault(victim, sig)))
    limit = 0.5 * KILLED_TIMEOUT_S if sig == signal.SIGKILL else 2 * STEP_TIMEOUT_S + 5
    for rank, r in results.items():
        if "error" in r:
            assert r["error"] in ("TransferError", "StepFailedError", "RendezvousError"), r
            assert r["seconds"] < limit, (rank, r)
    gen = {rank: r for rank, r in results.items() if r["side"] == "gen"}
    assert gen
    failed_somewhere = any("error" in r for r in results.values())
    assert failed_somewhere, results
    for rank, r in gen.items():
        state = r["state"]
        if "error" not in r:  # this gen rank finished the step: everything new, nothing torn
            assert mode == "in_place" and set(state.values()) == {"new"} and r["version"] == 101, r
            continue
        assert r["version"] == 100 and r["engine_version"] == 100, r  # the version is not advanced
        if mode == "staged":
            assert set(state.values()) == {"old"}, (rank, state)  # not one byte changed
            assert r["torn"] == [] and not r["needs_refit"] and r["serves"], r
        else:
            changed = {name for name, s in state.items() if s != "old"}
            assert changed <= set(r["torn"]), (rank, state, r["torn"])  # every changed tensor reported
            assert r["needs_refit"] == bool(r["torn"]) and r["serves"] == (not r["torn"]), r
            if r["torn"]:
                assert "torn" in r["message"] and "needs a new refit" in r["message"], r["message"]


@pytest.mark.slow
def test_in_place_tears_are_real_and_reported():
    """The in-place case is not vacuous: a sender killed mid-step really leaves some tensors new or
    mixed on a gen rank, and exactly those (or more) are named."""
    results = run(Scenario(TRAIN, GEN, {"mode": "in_place"}, Fault(0, signal.SIGKILL, after_exchanges=6)))
    gen = [r for r in results.values() if r["side"] == "gen" and "error" in r]
    assert any(set(r["state"].values()) != {"old"} for r in gen), gen
    for r in gen:
        assert {n for n, s in r["state"].items() if s != "old"} <= set(r["torn"])


@pytest.mark.slow
def test_timeout_then_recovery_on_the_same_port_with_a_replacement():
    """A stopped gen rank makes the step time out; the survivors close, set up again on the same
    address with a replacement process for the stopped one, and refit bitwise."""
    scenario = Scenario(1, 2, {"mode": "staged", "timeout_s": 6}, Fault(2, signal.SIGSTOP), recover=True)
    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    try:
        for rank in range(3):
            ranks.start(run_rank, rank, address, scenario)
        ranks.release()
        start = time.monotonic()
        ranks.wait_for([(0, "failed"), (1, "failed")], timeout_s=120)
        assert time.monotonic() - start < 60
        ranks.kill(2)
        ranks.start(replacement_rank, 2, address, scenario)
        results = ranks.wait_for([(0, "result"), (1, "result"), (2, "result")], timeout_s=120)
    finally:
        ranks.close()
    gen0, replacement = results[(1, "result")], results[(2, "result")]
    assert gen0["recovered"] and gen0["recovered_version"] == 105 and gen0["serves_after"], gen0
    assert replacement["recovered"] and replacement["recovered_version"] == 105, replacement
