"""A rank killed (SIGKILL) while megabyte messages are in flight, real processes over gloo: every
survivor that fails does so within seconds, not at its deadline, and the error names the lost rank.

gloo never completes nor fails a message a dead peer left half transferred (it waits for its own
timeout), so without the transport's watch the survivors stuck on such a message, and everyone
waiting on them, waited ``timeout_s``; with the toy model's few-hundred-byte messages this never
shows. Here each pair's step is one 16 MiB message and the victim dies 2 ms after posting it.
"""

import signal

import big_model
import pytest
from fault_ranks import Fault, Scenario
from test_transfer_faults import run

TRAIN, GEN = 2, 2
DEADLINE_S = 30
SEEN_WITHIN_S = 6  # the watch's checks (first at 0.25 s, then each second) and a loaded 2-core box
CASES = [("sender", "staged"), ("sender", "in_place"), ("receiver", "staged"), ("receiver", "in_place")]


@pytest.mark.parametrize("who,mode", CASES, ids=[f"{w}-{m}" for w, m in CASES])
def test_a_peer_killed_with_messages_in_flight_is_seen_within_seconds(who, mode):
    victim = 1 if who == "sender" else TRAIN + 1
    options = {"mode": mode, "timeout_s": DEADLINE_S, "bucket_bytes": 16 * big_model.BUCKET_BYTES}
    results = run(Scenario(TRAIN, GEN, options, Fault(victim, signal.SIGKILL, after_exchanges=2, delay_s=0.002),
                           big=True))
    failed = {rank: r for rank, r in results.items() if "error" in r}
    assert failed, results  # the victim's peers cannot all have finished
    for rank, r in failed.items():
        assert r["error"] in ("TransferError", "StepFailedError"), (rank, r)
        assert r["seconds"] < SEEN_WITHIN_S, (rank, r["seconds"], r["message"])
        assert "rank " in r["message"], r["message"]
    messages = " ".join(r["message"] for r in failed.values())
    assert f"rank {victim}" in messages, messages  # the dead rank is named (as gone, or by gloo's own error)
    for rank, r in results.items():
        if r["side"] == "gen" and "error" in r:
            assert r["version"] == 100, r  # the failed step is not applied
            if mode == "staged":
                assert set(r["state"].values()) == {"old"}, (rank, r["state"])
