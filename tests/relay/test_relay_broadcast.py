"""A relay by broadcast (``RelayOptions.broadcast``): each message of the trainer to the first replica reaches
every replica in one broadcast. Over gloo, which has no broadcast of its own in refit, the transport's default
sends the root's bytes to every member (``Transport.broadcast``): these tests check the plan, the executors and
the headers bitwise on CPU; ``test_relay_gpu.py`` checks NCCL's own broadcast (each byte leaves the trainer
once) on 4 GPUs."""

import time

import pytest
from relay_ranks import relay_ranks

from refit_core.contract.errors import OptionError
from refit_core.contract.options import RefitOptions, RelayOptions
from refit_core.kit.launch import free_port, spawn

BROADCAST = {"replicas": 4, "direct": 1, "broadcast": True}
PIPELINED = {"bucket_bytes": 1 << 12, "messages": {"direct_min_bytes": 1 << 11, "shared_max_bytes": 1 << 11}}


def test_a_broadcast_needs_one_root_and_changes_the_fingerprint():
    with pytest.raises(OptionError, match="broadcast=True. needs direct=1"):
        RelayOptions(replicas=4, direct=2, broadcast=True)
    chain = RefitOptions(relay={"replicas": 4, "direct": 1}).digest()
    assert RefitOptions(relay=BROADCAST).digest() != chain
    assert RefitOptions(relay={**BROADCAST, "broadcast": False}).digest() == chain


@pytest.mark.parametrize(("mode", "train_ranks"), [("in_place", 1), ("staged", 2)])
def test_every_replica_hears_the_trainers_broadcasts_bitwise(mode: str, train_ranks: int):
    results = spawn(relay_ranks, train_ranks + 4, f"127.0.0.1:{free_port()}", 2, BROADCAST, None, 30.0, train_ranks,
                    1, {**PIPELINED, "mode": mode}, True, False, None, timeout_s=180)
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    assert len({r["fingerprint"] for r in results}) == 1
    trainers, gens = results[:train_ranks], results[train_ranks:]
    assert all(t["train_peers"] == [0] for t in trainers)  # the trainers feed the first replica only
    assert trainers[0]["levels"] == ((0,), (1, 2, 3))
    for gen in gens:
        assert [s["mismatches"] for s in gen["steps"]] == [[], []]
        assert [(s["version"], s["engine_version"]) for s in gen["steps"]] == [(100, 100), (101, 101)]
        assert gen["counters"][-1]["sent_bytes"] == 0  # no replica forwards: the bytes come by broadcast
    for gen in gens[1:]:  # a relayed replica hears the trainers themselves
        assert {src for src, _ in gen["relay_pairs"]} == set(range(train_ranks))
    sent = trainers[0]["train_bytes"]  # the planner's schedule is the whole one
    received = [g["counters"][-1]["received_bytes"] for g in gens]
    assert received == [2 * sent] * 4, received


def test_a_dead_replica_fails_the_broadcast_step_on_every_rank_within_the_deadline():
    """Gen rank 1 (a relayed replica) dies once set up: the trainer's broadcast to it fails, and every other
    rank fails the step within the deadline; a relayed replica's error says how its step comes."""
    start = time.monotonic()
    results = spawn(relay_ranks, 5, f"127.0.0.1:{free_port()}", 1, BROADCAST, 2, 15.0, 1, 1, None, False, False,
                    None, timeout_s=180)
    assert time.monotonic() - start < 60
    trainer, gens = results[0], [results[1], results[3], results[4]]
    assert isinstance(trainer, tuple) and "between rank 0 and rank 2 failed" in trainer[2], trainer
    assert all(isinstance(r, tuple) and r[1] == "StepFailedError" for r in gens), gens
    assert all("gave up on the step" in r[2] and "rank 2" in r[2] for r in gens), gens
    assert all("hears the trainers' broadcasts with gen rank 0" in r[2] for r in gens[1:]), gens
