"""The relay's simulation: the pipelined relay against direct fanout, the simulator against 4 x H200
measurements, and what `refit plan --relay` prints."""

import pytest
import torch
from predictions import seconds

from refit_core import RefitOptions
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.options import RelayOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import load_config
from refit_core.plan.offline import PlanSummary, plan_from_metadata
from refit_core.plan.relay import ReplicaTree, relay_down_tree
from refit_core.plan.simulate import GpuPlacement, Simulation, Topology, simulate


def _one_node_into_replicas(replicas: int, direct: int):
    """8 train GPUs each holding 1/8 of a 1 GiB tensor, ``replicas`` engine replicas of one GPU each."""
    from refit_core.plan.planning import plan_with_relay

    spec = TensorSpec("model.w", (8192, 65536), torch.bfloat16)
    train = [[PieceMeta(spec, Box((1024 * i, 0), (1024, 65536)))] for i in range(8)]
    gen = [[PieceMeta(spec, Box((0, 0), spec.shape))] for _ in range(replicas)]
    settings = RefitOptions(bucket_bytes=512 << 20, relay={"replicas": replicas, "direct": direct})
    return plan_with_relay(train, gen, settings)


def test_simulated_relay_beats_direct_fanout_from_one_trainer_node_into_32_replicas():
    topology = Topology.parse("h200")
    direct_schedule, none = _one_node_into_replicas(32, 32)
    relay_schedule, relay = _one_node_into_replicas(32, 8)
    assert none is None and relay is not None and [len(level) for level in relay.tree.levels] == [8, 8, 8, 8]
    direct = simulate(direct_schedule, topology)
    relayed = simulate(relay_schedule, topology, relay=relay)
    # every replica's GiB leaves the trainer node's NICs directly: 32 GiB / 8 GPUs / 50 GB/s ...
    assert direct.busiest[1] == 4 << 30
    # ... with relay the trainers send 8 GiB (two rounds of 512 MiB per replica), each chain forwards them on
    trainer_out = max(n for (gpu, _, way), n in relayed.load_bytes.items() if way == "out" and gpu < 8)
    assert trainer_out == 1 << 30
    assert relayed.predicted_s < 0.9 * direct.predicted_s, (relayed.predicted_s, direct.predicted_s)
    assert relayed.bound_s == direct.bound_s  # each replica still receives its GiB once
    # pipelined: the last replica's step lands 3 hops of one round (512 MiB over a NIC, plus latencies) after
    # the trainers' last round, not 3 whole steps after it
    tail = relayed.relay_end_s - sum(relayed.round_seconds)
    assert len(relayed.round_seconds) == 2
    assert 3 * (512 << 20) / 50e9 < tail <= 3 * max(relayed.round_seconds) * (1 + 1e-9)
    assert relayed.predicted_s == relayed.relay_end_s
    assert any(line.startswith("relay:        pipelined 3 hop(s)") for line in relayed.lines())


def _h200x4_plan(model: str, train: str, gen: str, relay: RelayOptions) -> PlanSummary:
    """The metadata-only plan of a 4 x H200 run."""
    train_side, train_layout = parse_backend_layout(train)
    gen_side, gen_layout = parse_backend_layout(gen)
    return plan_from_metadata(get_plugin_manager(), load_config(model), train_side, train_layout, gen_side,
                              gen_layout, options=RefitOptions(relay=relay), device="cuda")


def _h200x4(model: str, train: str, gen: str, placement: GpuPlacement, relay: RelayOptions) -> Simulation:
    """The metadata-only plan of a 4 x H200 run, simulated on the h200 topology (NVLink between every pair)."""
    summary = _h200x4_plan(model, train, gen, relay)
    return simulate(summary.schedule, Topology.parse("h200"), placement, relay=summary.relay)


# Measured on 4 x H200 (NVLink NV18 switch), every refit bitwise: benchmarks/results/nvidia-h200-x4-fleet-2026-11-28.md
ONE_TO_THREE_DIRECT_MS = 130.9  # 1 trainer GPU -> 3 replicas of the Llama-3-8B shape (16.06 GB each), direct fanout
OF_THE_WIRE = {"llama-3-8b-shape": 0.878, "qwen3-30b-a3b-shape": 0.926}  # TP2 (GPUs 0,1) -> TP1 x DP2 (GPUs 2,3)
CHAIN_MS = 52.9  # the pipelined chain 1 -> 2 -> 3 of the same shape, 8 communicators per link (1.171x the broadcast)


def test_simulator_predicts_4xh200_direct_fanout_and_chain_within_10_percent():
    sim = _h200x4("llama-3-8b-shape", "megatron:tp=1", "vllm:tp=1,dp=3", GpuPlacement((0,), (1, 2, 3)),
                  RelayOptions(replicas=3))
    assert sim.predicted_s * 1e3 == pytest.approx(ONE_TO_THREE_DIRECT_MS, rel=0.10)
    # the pipelined chain that replaced the old waves (131.8 ms measured at d97d313)
    chain = _h200x4("llama-3-8b-shape", "megatron:tp=1", "vllm:tp=1,dp=3", GpuPlacement((0,), (1, 2, 3)),
                    RelayOptions(replicas=3, direct=1))
    assert chain.bytes == sim.bytes and chain.predicted_s < 0.4 * sim.predicted_s
    assert chain.predicted_s * 1e3 == pytest.approx(CHAIN_MS, rel=0.10)


def test_the_4xh200_chain_in_slices_is_predicted_slower_than_in_whole_rounds():
    """On NVLink a hop of a whole 512 MiB round costs 1.45 ms, while slices pay 15 us per piece on every link:
    the chooser keeps whole rounds there, as the 4 x H200 bucket sweep (smaller pieces slower) says."""
    summary = _h200x4_plan("llama-3-8b-shape", "megatron:tp=1", "vllm:tp=1,dp=3", RelayOptions(replicas=3, direct=1))
    assert summary.relay is not None
    placement, topology = GpuPlacement((0,), (1, 2, 3)), Topology.parse("h200")
    whole = simulate(summary.schedule, topology, placement, relay=summary.relay)
    sliced = simulate(summary.schedule, topology, placement,
                      relay=relay_down_tree(ReplicaTree(1, summary.relay.tree), summary.schedule, 16 << 20))
    assert sliced.bytes == whole.bytes and sliced.predicted_s > 1.1 * whole.predicted_s


# the relay by broadcast, in place, measured the same way: benchmarks/results/nvidia-h200-x4-broadcast-*-2026-11-28.md
BROADCAST_MS = {"llama-3-8b-shape": 45.2, "qwen3-30b-a3b-shape": 167.9}


@pytest.mark.parametrize("model", list(BROADCAST_MS))
def test_simulator_predicts_the_4xh200_relay_by_broadcast_within_10_percent(model: str):
    # whole-model replicas, as the bench's are (vLLM's layout with dp spreads Qwen3's experts over the replicas)
    sim = _h200x4(model, "megatron:tp=1", "dtensor:dp=3", GpuPlacement((0,), (1, 2, 3)),
                  RelayOptions(replicas=3, direct=1, broadcast=True))
    assert sim.predicted_s * 1e3 == pytest.approx(BROADCAST_MS[model], rel=0.10)
    assert sim.relay_end_s - sum(sim.round_seconds) < 1e-4  # the chain adds a chunk per hop, not a round
    assert any(line.startswith("relay:        by broadcast to 3 replicas") for line in sim.lines())


@pytest.mark.parametrize("model", list(OF_THE_WIRE))
def test_simulator_predicts_4xh200_tp2_into_two_replicas_within_10_percent(model: str):
    sim = _h200x4(model, "megatron:tp=2", "vllm:tp=1,dp=2", GpuPlacement((0, 1), (2, 3)), RelayOptions())
    # "of the wire": the wire moving the same bytes over the same pairs, i.e. the receiver-side bound
    assert sim.bound_s / sim.predicted_s == pytest.approx(OF_THE_WIRE[model], rel=0.10)


def test_refit_plan_compares_relay_trees_with_direct_fanout_and_plans_the_fastest(capsys):
    from refit_core.tools.cli import main

    assert main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "dtensor:dp=4",
                 "--device", "cpu", "--bucket-mb", "64", "--relay", "replicas=4", "--simulate",
                 "--topology", "gpus_per_node=8,nvlink_gbps=370,nic_gbps=50,latency_us=0"]) == 0
    out = capsys.readouterr().out
    table = out.split("simulated on gpus_per_node=8,nvlink_gbps=370,nic_gbps=50,latency_us=0:\n")[1]
    table = table.split("  best: ")[0].splitlines()
    predicted = {line.split("predicted ")[0].strip(): seconds(line.split("predicted ")[1]) for line in table}
    trees = ["chain, 1 root", "tree fanout 2, 1 root", "tree fanout 4, 1 root", "chain, 2 roots",
             "tree fanout 2, 2 roots"]
    # each tree, then the same tree in slices of 16 MiB: tiny-llama's messages all fit one, so no faster
    assert list(predicted) == ["direct", *(label for tree in trees for label in (tree, f"{tree}, chunks 16.0 MiB")),
                               "broadcast"]
    assert all(predicted[f"{tree}, chunks 16.0 MiB"] == predicted[tree] for tree in trees)
    best = out.split("  best: ")[1]
    fastest = best.split(" (")[0]
    assert predicted[fastest] == min(predicted.values()), (best, predicted)  # printed to the microsecond
    if fastest != "direct":
        speedup = float(best.split("relay wins, ")[1].split("x faster")[0])
        assert speedup == pytest.approx(predicted["direct"] / predicted[fastest], rel=0.1), (speedup, predicted)
    assert "x the receiver-side bound" in best
