"""The relay and forwarding choices as a library call: what an RL framework asks before its first refit."""

import torch

from refit_core import RefitOptions
from refit_core.contract.options import RelayOptions
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import load_config
from refit_core.plan.choose import FORWARD_FLOORS, choose_forwarding, choose_relay
from refit_core.plan.offline import PlanSummary, plan_from_metadata
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.simulate import Topology


def test_an_rl_framework_asks_for_the_fastest_relay_from_one_trainer_node_into_32_replicas():
    # test_relay's case: 8 train GPUs each holding 1/8 of a 1 GiB tensor, 32 engine replicas of one GPU each
    spec = TensorSpec("model.w", (8192, 65536), torch.bfloat16)
    train = [[PieceMeta(spec, Box((1024 * i, 0), (1024, 65536)))] for i in range(8)]
    gen = [[PieceMeta(spec, Box((0, 0), spec.shape))] for _ in range(32)]

    def plan(relay: RelayOptions) -> PlanSummary:
        schedule, relay_plan = plan_with_relay(train, gen, RefitOptions(bucket_bytes=512 << 20, relay=relay))
        return PlanSummary(schedule, len(train), len(gen), 0.0, relay=relay_plan)

    seen: list[int] = []
    choice = choose_relay(plan, RelayOptions(replicas=32), Topology.parse("h200"),
                          on_prediction=lambda p: seen.append(p.relay.direct))
    assert seen == [p.relay.direct for p in choice.candidates] == [32, 16, 8, 4, 2, 1]
    assert choice.baseline is choice.candidates[0] and choice.baseline.baseline and choice.baseline.waves == 1
    assert not choice.chose_baseline and choice.relay.direct == 8, choice.candidates
    assert choice.relay.replicas == 32 and choice.plan.relay is not None
    assert [len(w) for w in choice.plan.relay.waves.waves] == [8, 8, 16]
    assert choice.predicted_s == min(p.predicted_s for p in choice.candidates if p.predicted_s is not None)
    assert choice.speedup > 1 / 0.9  # test_relay: relay beats direct fanout by more than 10 %


def test_an_rl_framework_asks_whether_forwarding_within_nodes_pays():
    # test_node_forwarding's case: tiny-llama, FSDP 2 -> TP 2 on nodes of 2 GPUs
    train, train_layout = parse_backend_layout("dtensor:fsdp=2")
    gen, gen_layout = parse_backend_layout("dtensor:tp=2")
    config = load_config("tiny-llama")

    def plan(relay: RelayOptions) -> PlanSummary:
        return plan_from_metadata(get_plugin_manager(), config, train, train_layout, gen, gen_layout,
                                  options=RefitOptions(relay=relay), device="cuda")

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
