"""Relay fanout: a pipelined tree of replicas, and real refits over gloo where engine replicas forward to each other."""

import time

import pytest
import torch
from relay_ranks import relay_ranks

from refit_core import OptionError, PlanError, RefitOptions
from refit_core.contract.options import RelayOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.launch import free_port, spawn
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.relay import plan_tree, replica_tree

RELAY = {"replicas": 4, "direct": 1, "fanout": 1}


def test_relay_tree_is_chains_by_default_and_a_tree_of_any_fanout():
    chains = plan_tree(8, 2)
    assert chains.parent == (-1, -1, 0, 1, 2, 3, 4, 5)  # two chains: 0-2-4-6 and 1-3-5-7
    assert [chains.root_of(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    tree = plan_tree(10, 1, 3)
    assert tree.children(0) == (1, 2, 3) and tree.children(1) == (4, 5, 6) and tree.children(3) == ()
    assert [len(level) for level in tree.levels] == [1, 3, 6]
    assert plan_tree(4, 4).levels == ((0, 1, 2, 3),)


def _metas(rows: int) -> list[PieceMeta]:
    spec = TensorSpec("w", (8, 4), torch.float32)
    return [PieceMeta(spec, Box((0, 0), (rows, 4)))]


def test_relay_plan_forwards_every_root_message_down_the_tree_round_for_round():
    train = [_metas(4), [PieceMeta(TensorSpec("w", (8, 4), torch.float32), Box((4, 0), (4, 4)))]]
    gen = [_metas(8)] * 4
    settings = RefitOptions(bucket_bytes=1 << 20, relay=RELAY)
    schedule, plan = plan_with_relay(train, gen, settings)
    assert plan is not None and plan.tree.parent == (-1, 0, 1, 2)
    assert {m.dst for msgs in schedule.rounds for m in msgs} == {0}  # the trainers feed replica 0 only
    fed = [m for msgs in schedule.rounds for m in msgs]
    for hop, (src, dst) in enumerate([(0, 1), (1, 2), (2, 3)]):
        relayed = [m for msgs in plan.schedule.rounds for m in msgs if (m.src, m.dst) == (src, dst)]
        assert [(m.nbytes, m.dst_segments, m.parts) for m in relayed] == [
            (m.nbytes, m.dst_segments, m.parts) for m in fed], hop
    with pytest.raises(PlanError, match="gen rank 2 .replica 2. has other destination pieces"):
        replica_tree(RelayOptions(**RELAY), [_metas(8), _metas(8), _metas(4), _metas(8)])
    with pytest.raises(PlanError, match="cannot form 3 equal replicas"):
        replica_tree(RelayOptions(replicas=3, direct=1), gen)


def test_node_forwarding_needs_in_place_mode_and_relay_leaves_fingerprints_alone_when_off():
    RefitOptions(mode="staged", relay=RELAY)  # replica relay forwards staged steps too
    with pytest.raises(OptionError, match="needs mode='in_place'"):
        RefitOptions(mode="staged", relay={"node_ranks": 2})
    assert "relay" not in RefitOptions().agreed_wire()
    assert RefitOptions(relay={"replicas": 4}).digest() == RefitOptions().digest()
    assert RefitOptions(relay=RELAY).agreed_wire()["relay"] == RELAY


def _run(steps=2, relay=RELAY, die_after_setup=None, timeout_s=30.0, options=None, record=False, stall=None):
    return spawn(relay_ranks, 5, f"127.0.0.1:{free_port()}", steps, relay, die_after_setup, timeout_s, 1, 1,
                 options, record, False, stall, timeout_s=180)


PIPELINED = {"bucket_bytes": 1 << 12, "messages": {"direct_min_bytes": 1 << 11, "shared_max_bytes": 1 << 11}}
"""Small buckets and messages: the toy step travels in several rounds, so forwarding overlaps arrival."""


def test_a_chain_of_three_relayed_replicas_gets_each_step_bitwise_pipelined_message_by_message():
    results = _run(steps=2, options=PIPELINED, record=True)
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    assert len({r["fingerprint"] for r in results}) == 1
    trainer, gens = results[0], results[1:]
    assert trainer["train_peers"] == [0]  # the trainer sends to replica 0 only
    assert trainer["levels"] == ((0,), (1,), (2,), (3,))
    assert trainer["relay_messages"] > 0
    for gen in gens:
        assert [s["mismatches"] for s in gen["steps"]] == [[], []]
        assert [(s["version"], s["engine_version"]) for s in gen["steps"]] == [(100, 100), (101, 101)]
        assert gen["setup"]["metadata_bytes"] > 0 and gen["setup"]["bind_s"] is not None
    # the transports' own counters: the trainer sends each byte once per step, each replica receives it once
    # and every replica but the last sends it on once, whatever the number of replicas
    step_bytes = trainer["train_bytes"]
    for step in range(2):
        assert trainer["counters"][step]["sent_bytes"] == (step + 1) * step_bytes
        for hop, gen in enumerate(gens):
            counted = gen["counters"][step]
            assert counted["received_bytes"] == (step + 1) * step_bytes, (hop, counted)
            assert counted["sent_bytes"] == (0 if hop == 3 else (step + 1) * step_bytes), (hop, counted)
    # the step's timeline: a relaying replica forwards its first round before its last round has landed
    for gen in gens[1:3]:
        for spans in gen["timelines"]:
            received = [end for phase, _, _, end in spans if phase == "transfer"]
            forwarded = [start for phase, _, start, _ in spans if phase == "forward"]
            assert len(received) > 2 and forwarded, spans
            assert min(forwarded) < max(received), spans


def test_a_staged_tree_of_fanout_two_relays_bitwise_and_commits_every_replica():
    results = _run(steps=2, relay={**RELAY, "fanout": 2}, options={**PIPELINED, "mode": "staged"})
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    assert results[0]["levels"] == ((0,), (1, 2), (3,))
    for gen in results[1:]:
        assert [s["mismatches"] for s in gen["steps"]] == [[], []]
        assert [s["engine_version"] for s in gen["steps"]] == [100, 101]


def test_relay_changes_the_fingerprint():
    gen = [_metas(8)] * 4
    train = [_metas(8)]
    with_relay, _ = plan_with_relay(train, gen, RefitOptions(bucket_bytes=1 << 20, relay=RELAY))
    without, none = plan_with_relay(train, gen, RefitOptions(bucket_bytes=1 << 20, relay={"replicas": 4}))
    chains, _ = plan_with_relay(train, gen, RefitOptions(bucket_bytes=1 << 20, relay={**RELAY, "direct": 2}))
    assert none is None and len({with_relay.fingerprint, without.fingerprint, chains.fingerprint}) == 3


def test_a_dead_relaying_replica_fails_the_step_on_its_parent_and_every_replica_below_it():
    """Gen rank 1 (replica 1 of the chain 0 -> 1 -> 2 -> 3) dies after setup. Its parent (replica 0) finds
    out when it posts the step's header to it, before any byte lands: its weights are unchanged. Replica 2
    waits on its dead parent, replica 3 on replica 2: both raise StepFailedError within the deadline,
    each naming its relay parent."""
    start = time.monotonic()
    results = _run(steps=1, die_after_setup=2, timeout_s=15)
    parent, below = results[1], results[3:]
    assert isinstance(parent, tuple) and parent[1] == "StepFailedError", parent
    assert "weights are unchanged" in parent[2] and parent[3] == [], parent
    for gen_rank, (result, relay_parent) in enumerate(zip(below, (1, 2)), start=2):
        assert isinstance(result, tuple) and result[1] == "StepFailedError", result
        assert f"gen rank {gen_rank} (relayed: its relay parent is gen rank {relay_parent}" in result[2], result
    assert time.monotonic() - start < 60


def test_a_stalled_relaying_replica_fails_every_replica_below_it_at_the_deadline():
    """Gen rank 1 hangs once set up (alive, its connections open: no watch can tell). Replicas 2 and 3 fail
    at their 5 s deadline, naming their relay parents; the stalled replica's parent fails too."""
    start = time.monotonic()
    results = _run(steps=1, stall=2, timeout_s=5)
    assert time.monotonic() - start < 60
    for gen_rank, relay_parent in ((2, 1), (3, 2)):
        result = results[1 + gen_rank]
        assert isinstance(result, tuple) and result[1] == "StepFailedError", result
        assert f"(relayed: its relay parent is gen rank {relay_parent}" in result[2], result
    assert isinstance(results[1], tuple) and results[1][1] == "StepFailedError", results[1]


def test_a_relay_opens_eight_nccl_communicators_per_link_unless_told():
    assert RefitOptions(relay=RELAY).options_for("nccl").comms_per_link == 8
    assert RefitOptions(relay=RELAY, nccl={"comms_per_link": 2}).options_for("nccl").comms_per_link == 2
    assert RefitOptions(relay={"replicas": 4}).options_for("nccl").comms_per_link is None  # no relay: the default
