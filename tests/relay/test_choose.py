"""The relay and forwarding choices as a library call: what an RL framework asks before its first refit."""

import torch

from refit_core import RefitOptions
from refit_core.contract.options import RelayOptions
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import load_config
from refit_core.plan.choose import (
    FORWARD_FLOORS,
    RELAY_CHUNKS,
    Planner,
    Prediction,
    RelayShape,
    choose_forwarding,
    choose_relay,
)
from refit_core.plan.offline import PlanSummary, plan_from_metadata
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.relay import plan_tree
from refit_core.plan.simulate import Topology


def one_node_into_32_replicas(default_bucket: int, planned: list[tuple[int, int | None]] | None = None) -> Planner:
    """test_relay_simulation's case as a planner: 8 train GPUs each holding 1/8 of a 1 GiB tensor, 32 engine
    replicas of one GPU; ``default_bucket`` where the chooser gives none, each call's (direct, bucket) appended to
    ``planned``."""
    spec = TensorSpec("model.w", (8192, 65536), torch.bfloat16)
    train = [[PieceMeta(spec, Box((1024 * i, 0), (1024, 65536)))] for i in range(8)]
    gen = [[PieceMeta(spec, Box((0, 0), spec.shape))] for _ in range(32)]

    def plan(relay: RelayOptions, bucket_bytes: int | None = None) -> PlanSummary:
        if planned is not None:
            planned.append((relay.direct, bucket_bytes))
        options = RefitOptions(bucket_bytes=bucket_bytes or default_bucket, relay=relay)
        schedule, relay_plan = plan_with_relay(train, gen, options)
        return PlanSummary(schedule, len(train), len(gen), 0.0, relay=relay_plan)

    return plan


def test_an_rl_framework_asks_for_the_fastest_relay_from_one_trainer_node_into_32_replicas():
    planned: list[tuple[int, int | None]] = []
    plan = one_node_into_32_replicas(512 << 20, planned)

    seen: list[Prediction] = []
    choice = choose_relay(plan, RelayOptions(replicas=32), Topology.parse("h200"), buckets=(None, 32 << 20),
                          chunks=(0,), broadcast=False, on_prediction=seen.append)
    assert seen == list(choice.candidates)
    assert choice.baseline is seen[0] and seen[0].baseline and seen[0].shape is RelayShape.DIRECT
    # 1, 2, 4... roots, chains first, then trees of fanout 2, 4... while they get faster (1 root, 512 MiB: a
    # tree of fanout 2 beats the 31-hop chain, fanout 4 does not); 16 roots not planned: the trainers' NICs
    # alone would take 16 x 1 GiB / 8 / 50 GB/s, slower than the best so far
    assert [p.label for p in seen[1:5]] == ["chain, 1 root", "tree fanout 2, 1 root", "tree fanout 4, 1 root",
                                            "chain, 1 root, bucket 32.0 MiB"]
    assert seen[2].predicted_s < seen[1].predicted_s < seen[3].predicted_s
    assert [p.relay.direct for p in seen if p.bucket_bytes is None] == [32, 1, 1, 1, 2, 2, 4, 4, 8, 8]
    assert choice.skipped == (16,)
    assert seen[-1].label == "tree fanout 2, 8 roots, bucket 32.0 MiB" and seen[-1].levels == 3
    # the trainers' schedule is planned once per roots and bucket (chains first: the winner is no derived plan)
    assert planned == [(32, None), *[(d, b) for d in (1, 2, 4, 8) for b in (None, 32 << 20)]]
    # 8 chains of 4 replicas, 32 MiB rounds: 1.12x the bound; the trainers' NICs feed 8 replicas, not 32
    assert not choice.chose_baseline and choice.chosen.label == "chain, 8 roots, bucket 32.0 MiB"
    assert choice.relay == RelayOptions(replicas=32, direct=8, fanout=1)
    assert choice.plan.relay is not None and choice.plan.relay.tree.parent == plan_tree(32, 8, 1).parent
    assert choice.plan.schedule.bucket_bytes == 32 << 20
    assert choice.predicted_s == min(p.predicted_s for p in seen if p.predicted_s is not None)
    assert choice.predicted_s < 1.15 * choice.chosen.bound_s
    assert choice.speedup > 3  # direct fanout: every replica's GiB leaves the trainers' NICs


def test_an_rl_framework_asks_whether_forwarding_within_nodes_pays():
    # test_node_forwarding's case: tiny-llama, FSDP 2 -> TP 2 on nodes of 2 GPUs
    train, train_layout = parse_backend_layout("dtensor:fsdp=2")
    gen, gen_layout = parse_backend_layout("dtensor:tp=2")
    config = load_config("tiny-llama")

    def plan(relay: RelayOptions, bucket_bytes: int | None = None) -> PlanSummary:
        return plan_from_metadata(get_plugin_manager(), config, train, train_layout, gen, gen_layout,
                                  options=RefitOptions(bucket_bytes=bucket_bytes, relay=relay), device="cuda")

    slow_nic = Topology.parse("gpus_per_node=2,nvlink_gbps=370,nic_gbps=1,latency_us=0")
    choice = choose_forwarding(plan, RelayOptions(node_ranks=2), slow_nic)
    assert [p.relay.forward_min_bytes for p in choice.candidates[1:]] == list(FORWARD_FLOORS)
    assert not choice.candidates[0].relay.forwards_within_nodes and choice.candidates[0].baseline
    assert choice.candidates[1].forwarded_bytes == 2560  # the norms of tiny-llama's layers: 2.5 KiB
    assert choice.candidates[2].predicted_s is None  # nothing shared reaches 64 KiB
    assert not choice.chose_baseline and choice.relay == RelayOptions(node_ranks=2, forward_min_bytes=0)
    assert choice.plan.relay is not None and choice.speedup > 1

    per_message_cost = Topology.parse("gpus_per_node=2,nvlink_gbps=370,nic_gbps=50,latency_us=15")
    choice = choose_forwarding(plan, RelayOptions(node_ranks=2), per_message_cost)
    assert choice.chose_baseline and choice.relay == RelayOptions() and choice.plan.relay is None
    assert choice.speedup == 1.0


def test_a_deep_chain_is_chosen_in_slices_and_planned_with_them():
    # the same 1 GiB tensor from 8 train GPUs into 32 replicas: one chain of 31 hops over the NICs
    plan = one_node_into_32_replicas(64 << 20)

    choice = choose_relay(plan, RelayOptions(replicas=32, fanout=1), Topology.parse("h200"), chunks=RELAY_CHUNKS,
                          broadcast=False)
    one_root = [p for p in choice.candidates if p.relay.direct == 1]
    # a 31-hop chain: whole 64 MiB rounds pay a round per hop, 16 and 8 MiB slices a slice per hop; at 4 MiB
    # the 15 us per piece outweighs what the hops save, and no smaller slice is tried
    assert [p.chunk_bytes for p in one_root] == [0, 16 << 20, 8 << 20, 4 << 20]
    seconds = [p.predicted_s or 0.0 for p in one_root]
    assert seconds[2] < seconds[1] < 0.9 * seconds[0] and seconds[3] > seconds[2]
    best = min(choice.candidates, key=lambda p: p.predicted_s or float("inf"))
    assert choice.chosen is best and best.chunk_bytes and best.label.endswith(f"chunks {best.chunk_bytes >> 20}.0 MiB")
    assert choice.plan.relay is not None and choice.plan.relay.chunk_bytes == best.chunk_bytes
    assert choice.plan.relay.tree.parent == plan_tree(32, best.relay.direct, 1).parent
    assert choice.predicted_s == best.predicted_s < 1.15 * best.bound_s


def test_with_nccl_broadcasts_the_fleet_is_one_broadcast_per_message():
    # the same 1 GiB tensor from 8 train GPUs into 32 replicas, where the transport broadcasts (NCCL)
    plan = one_node_into_32_replicas(512 << 20)

    choice = choose_relay(plan, RelayOptions(replicas=32), Topology.parse("h200"), chunks=(0,))
    trees = [p for p in choice.candidates if p.shape in (RelayShape.CHAIN, RelayShape.TREE)]
    assert choice.chosen.shape is RelayShape.BROADCAST and choice.chosen.label == "broadcast"
    assert choice.relay == RelayOptions(replicas=32, direct=1, broadcast=True)
    assert choice.plan.relay is not None and choice.plan.relay.broadcast
    assert choice.predicted_s < min(p.predicted_s or float("inf") for p in trees)
    assert choice.predicted_s < 1.05 * choice.chosen.bound_s  # 31 hops cost a chunk each, not a round
