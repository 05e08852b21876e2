"""Forwarding within nodes: regions several gen ranks of one node hold cross the network once per node."""

import time

import pytest
import torch
from predictions import seconds
from relay_ranks import relay_ranks

from refit_core import OptionError, RefitOptions
from refit_core.contract.options import RelayOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, Quantization, TensorSpec
from refit_core.kit.launch import free_port, spawn
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.relay import plan_node_forwarding

NORM = TensorSpec("model.norm.weight", (64,), torch.float32)
QA = TensorSpec("model.layers.0.self_attn.q_a_proj.weight", (32, 64), torch.float32)
EMBED = TensorSpec("model.embed_tokens.weight", (128, 64), torch.float32)


def _tp_rank(rank: int, world: int) -> list[PieceMeta]:
    """A TP rank: its vocabulary slice of the embedding, the norm and ``q_a`` replicated."""
    rows = EMBED.shape[0] // world
    return [PieceMeta(EMBED, Box((rank * rows, 0), (rows, 64))), PieceMeta(QA, QA.full_box()),
            PieceMeta(NORM, NORM.full_box())]


def test_each_shared_region_is_fed_to_one_leader_per_node_and_forwarded_to_the_others():
    gen = [_tp_rank(r, 4) for r in range(4)]  # one replica of TP 4, two nodes of 2 ranks
    plan = plan_node_forwarding(2, gen, 1 << 20)
    assert plan is not None and plan.within_nodes
    moves = sorted((m.src, m.dst, s.piece) for msgs in plan.schedule.rounds for m in msgs for s in m.dst_segments)
    # q_a (the larger) goes to rank 0 of each node, the norm to rank 1: the node's two ranks swap
    assert moves == [(0, 1, 1), (1, 0, 2), (2, 3, 1), (3, 2, 2)]
    assert plan.forwarded == {(1, 1), (0, 2), (3, 1), (2, 2)}
    fed = plan.direct_metas(gen)
    assert [[m.box.numel for m in metas] for metas in fed] == [[2048, 2048, 0], [2048, 0, 64]] * 2
    assert [[m.spec for m in metas] for metas in fed] == [[m.spec for m in metas] for metas in gen]  # indices kept


def test_a_rank_holding_only_shared_regions_is_still_fed_and_quantized_regions_are_not_forwarded():
    assert plan_node_forwarding(2, [[PieceMeta(QA, QA.full_box())]] * 2, 1 << 20) is None  # rank 1 needs the trainers
    fp8 = TensorSpec("w", (256, 256), torch.float8_e4m3fn, quant=Quantization.block_fp8("w_scale"))
    scales = TensorSpec("w_scale", (2, 2), torch.float32)
    gen = [[PieceMeta(QA, QA.full_box()), PieceMeta(fp8, fp8.full_box()), PieceMeta(scales, scales.full_box())]] * 2
    plan = plan_node_forwarding(2, gen, 1 << 20)
    assert plan is not None and plan.forwarded == {(1, 0)}  # q_a forwarded; the FP8 weight, scales fed to both


def test_forwarding_between_two_ranks_of_one_gpu_is_refused_before_any_collective():
    from refit_core.contract.errors import PlanError
    from refit_core.plan.links import Placement
    from refit_core.plan.relay import check_relay_pairs

    plan = plan_node_forwarding(2, [_tp_rank(r, 2) for r in range(2)], 1 << 20)
    assert plan is not None
    check_relay_pairs(plan, [Placement("host", "cuda:GPU-a"), Placement("host", "cuda:GPU-b")])
    check_relay_pairs(plan, [Placement("host", "cpu")] * 2)  # gloo connects ranks of one host
    with pytest.raises(PlanError, match="gen ranks 0 and 1 share one GPU .cuda:GPU-a."):
        check_relay_pairs(plan, [Placement("host", "cuda:GPU-a")] * 2)


def test_forwarding_options_agree_and_refuse_to_combine_with_replica_relay():
    with pytest.raises(OptionError, match="cannot be combined"):
        RelayOptions(replicas=4, direct=1, node_ranks=8)
    with pytest.raises(OptionError, match="needs mode='in_place'"):
        RefitOptions(mode="staged", relay={"node_ranks": 8})
    assert RefitOptions(relay={"node_ranks": 8}).agreed_wire()["relay"] == {
        "replicas": 1, "direct": 0, "fanout": 1, "node_ranks": 8, "forward_min_bytes": 1 << 20}
    assert RefitOptions(relay={"replicas": 4, "direct": 1}).agreed_wire()["relay"] == {
        "replicas": 4, "direct": 1, "fanout": 1}
    assert RefitOptions(relay={"node_ranks": 1}).digest() == RefitOptions().digest()


def test_simulated_forwarding_sends_a_replicated_tensor_once_per_node_and_beats_feeding_every_gpu():
    from refit_core.plan.simulate import Topology, simulate

    layers = [TensorSpec(f"model.layers.{i}.self_attn.q_a_proj.weight", (1024, 8192), torch.bfloat16)
              for i in range(8)]
    train = [[PieceMeta(spec, spec.full_box())] for spec in layers]  # train GPU i holds layer i
    gen = [[PieceMeta(spec, spec.full_box()) for spec in layers] for _ in range(8)]  # one node, TP 8
    topology = Topology.parse("h100")
    direct, none = plan_with_relay(train, gen, RefitOptions(bucket_bytes=512 << 20))
    forwarded, relay = plan_with_relay(train, gen, RefitOptions(bucket_bytes=512 << 20, relay={"node_ranks": 8}))
    assert none is None and relay is not None
    before, after = simulate(direct, topology), simulate(forwarded, topology, relay=relay)
    assert direct.summary.bytes == 64 * (16 << 20)  # every gen GPU gets every layer from the trainers ...
    assert forwarded.summary.bytes == 8 * (16 << 20)  # ... now the node gets each layer once
    assert sorted(m.dst for msgs in forwarded.rounds for m in msgs) == list(range(8))  # one leader per layer
    assert relay.schedule.summary.bytes == 56 * (16 << 20)  # each leader forwards its layer to 7 peers
    assert after.predicted_s < 0.5 * before.predicted_s, (after.predicted_s, before.predicted_s)
    assert any(line.startswith("forwarding:") for line in after.lines())


def test_refit_plan_forwards_within_nodes_and_prints_the_time_without(capsys):
    from refit_core.tools.cli import main

    assert main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "dtensor:tp=2",
                 "--device", "cpu", "--forward-within-nodes", "--forward-min-bytes", "0", "--simulate",
                 "--topology", "gpus_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert "forwarding:   within nodes of 2 gen ranks" in out
    # tiny-llama's norms are 128 B: at the default 15 us per message, the extra forwarding round loses
    forwarded = seconds(out.split("  predicted:    ")[1].split(" over ")[0])
    unforwarded = seconds(out.split("without forwarding within nodes the same refit predicts ")[1].split(";")[0])
    assert forwarded > unforwarded, (forwarded, unforwarded)
    verdict = out.split("forwarding is ")[1].splitlines()[0]
    assert verdict.endswith("x slower: run without it, or raise --forward-min-bytes"), verdict
    slower = float(verdict.split("x ")[0])
    assert slower == pytest.approx(forwarded / unforwarded, rel=0.03), (slower, forwarded, unforwarded)
    assert main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "dtensor:tp=2",
                 "--device", "cpu", "--forward-within-nodes", "--topology", "gpus_per_node=2"]) == 0
    assert "forwarding:   none: no region of at least 1048576 bytes" in capsys.readouterr().out  # tiny norms


def _predictions(out: str) -> dict[str, str]:
    """``--forward-min-bytes auto``'s table: label -> what it printed."""
    table = out.split("each floor simulated on")[1].split("  best: ")[0].splitlines()[1:]
    return {line[:30].strip(): line[30:].strip() for line in table}


@pytest.mark.parametrize("nic, wins", [("nic_gbps=50,latency_us=15", False), ("nic_gbps=1,latency_us=0", True)])
def test_refit_plan_chooses_the_forwarding_floor_by_simulation(capsys, nic, wins):
    from refit_core.tools.cli import FORWARD_FLOORS, main
    from refit_core.units import format_bytes

    topology = f"gpus_per_node=2,nvlink_gbps=370,{nic}"
    assert main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "dtensor:tp=2",
                 "--device", "cpu", "--forward-within-nodes", "--forward-min-bytes", "auto",
                 "--topology", topology]) == 0
    out = capsys.readouterr().out
    table = _predictions(out)
    assert list(table) == ["no forwarding", *(f"forward_min_bytes {format_bytes(f)}" for f in FORWARD_FLOORS)]
    assert table["forward_min_bytes 64.0 KiB"] == "nothing shared is that large"  # tiny-llama's norms: 128 B
    direct, floor0 = table["no forwarding"], table["forward_min_bytes 0 B"]
    assert floor0.endswith("2.5 KiB forwarded")
    # with a slow NIC and no per-message cost, feeding the 2 norms of a layer to one rank of the node wins;
    # at 15 us per message, the extra forwarding round loses
    best = out.split("  best: ")[1].splitlines()[0]
    if wins:
        assert best.startswith("forward_min_bytes 0 B,"), best
        assert "forwarding:   within nodes of 2 gen ranks" in out
    else:
        assert best == "forwarding does not win", best
        assert "forwarding:" not in out.split("  best: ")[1]
    assert (seconds(floor0) < seconds(direct)) == wins, (floor0, direct)


def _run(relay: dict, steps: int = 2, die_after_setup: int | None = None, timeout_s: float = 30.0):
    """2 toy train ranks -> one toy engine over 2 gen ranks (its fused qkv and norm on both)."""
    return spawn(relay_ranks, 4, f"127.0.0.1:{free_port()}", steps, relay, die_after_setup, timeout_s, 2, 2,
                 timeout_s=180)


def test_two_gen_ranks_of_a_node_forward_their_shared_regions_to_each_other_bitwise():
    forwarded, direct = _run({"node_ranks": 2, "forward_min_bytes": 0}), _run({})
    errors = [r for r in forwarded + direct if isinstance(r, tuple)]
    assert not errors, errors
    for results in (forwarded, direct):
        assert len({r["fingerprint"] for r in results}) == 1
        for gen in results[2:]:
            assert [s["mismatches"] for s in gen["steps"]] == [[], []]
            assert [(s["version"], s["engine_version"]) for s in gen["steps"]] == [(100, 100), (101, 101)]
    assert forwarded[0]["fingerprint"] != direct[0]["fingerprint"]
    assert forwarded[2]["relay_pairs"] == forwarded[3]["relay_pairs"] == [(0, 1), (1, 0)]  # each leads some
    # bytes the gen ranks get from the trainers: the fused qkv (64 x 32 floats) and the norm (32 floats)
    # now reach one gen rank each, not both
    shared = (32 + 2 * 16) * 32 * 4 + 32 * 4
    assert sum(r["train_bytes"] for r in direct[2:]) - sum(r["train_bytes"] for r in forwarded[2:]) == shared
    assert all(r["train_bytes"] > 0 for r in forwarded[2:])


def test_a_dead_node_peer_fails_the_step_on_the_rank_forwarding_with_it():
    start = time.monotonic()
    results = _run({"node_ranks": 2, "forward_min_bytes": 0}, steps=1, die_after_setup=3, timeout_s=15)
    survivor = results[2]
    assert isinstance(survivor, tuple) and survivor[1] == "StepFailedError", survivor
    assert "gen rank 0" in survivor[2], survivor
    assert time.monotonic() - start < 170
