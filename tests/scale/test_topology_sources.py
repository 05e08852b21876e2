"""Topology-aware source choice: among identical DP replicas, each receiver is served from its own node."""

from __future__ import annotations

import torch

from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, TensorSpec
from refit_core.plan.reference import plan_transfers
from refit_core.plan.schedule import build_schedule
from refit_core.plan.simulate import GpuPlacement, LinkKind, Topology, simulate

SPEC = TensorSpec("w", (64, 1024), torch.float32)


def _replicated_rows(replicas: int, shards: int) -> list[list[PieceMeta]]:
    """``replicas`` DP copies, each sharding ``w`` by rows over ``shards`` ranks (replica-major)."""
    rows = SPEC.shape[0] // shards
    return [[PieceMeta(SPEC, Box((s * rows, 0), (rows, SPEC.shape[1])))]
            for _ in range(replicas) for s in range(shards)]


def test_each_receiver_is_served_by_the_replica_on_its_node() -> None:
    topology = Topology(gpus_per_node=4, latency_us=0.0)
    src = _replicated_rows(replicas=2, shards=2)  # train ranks 0, 1 on node 0; 2, 3 on node 1
    dst = [[PieceMeta(SPEC, SPEC.full_box())] for _ in range(4)]  # gen ranks: 2 per node
    placement = GpuPlacement(train=(0, 1, 4, 5), gen=(2, 3, 6, 7))

    near = plan_transfers(src, dst, distance=placement.distance(topology))
    node = {0: 0, 1: 0, 2: 1, 3: 1}
    assert {(t.src, t.dst) for t in near} == {(s, d) for d in range(4) for s in range(4) if node[s] == node[d]}

    def nic_bytes(transfers) -> int:
        sim = simulate(build_schedule(transfers, 4, 4, 1 << 20), topology, placement)
        return sum(n for (gpu, kind, way), n in sim.load_bytes.items() if kind is LinkKind.NIC and way == "in")

    blind = plan_transfers(src, dst)
    assert nic_bytes(near) == 0
    assert nic_bytes(blind) > 0  # the load balancer alone sends across nodes
    busiest = max(sum(t.nbytes for t in near if t.src == s) for s in range(4))
    assert busiest == SPEC.nbytes  # each train rank sends its half-rows to the 2 receivers of its node


def test_load_spreads_over_replicas_at_the_same_distance() -> None:
    topology = Topology(gpus_per_node=8)
    src = _replicated_rows(replicas=4, shards=1)  # four whole copies on one node
    dst = [[PieceMeta(SPEC, SPEC.full_box())] for _ in range(4)]
    placement = GpuPlacement(train=(0, 1, 2, 3), gen=(4, 5, 6, 7))
    transfers = plan_transfers(src, dst, distance=placement.distance(topology), balance_split_bytes=1 << 30)
    assert sorted(t.src for t in transfers) == [0, 1, 2, 3]  # every replica sends once
