"""Planner: matching, balancing and every validation error, asserted by message."""

import pytest
import torch

from refit_core.contract.errors import PlanError
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, TensorSpec
from refit_core.plan.reference import plan_transfers
from refit_core.plan.schedule import build_schedule

F32, BF16 = torch.float32, torch.bfloat16


def meta(name, shape, offsets, sizes, dtype=F32):
    return PieceMeta(TensorSpec(name, shape, dtype), Box(offsets, sizes))


def full(name, shape, dtype=F32):
    return meta(name, shape, (0,) * len(shape), shape, dtype)


def test_rows_to_columns_covers_every_destination_byte_once():
    src = [[meta("w", (4, 6), (0, 0), (2, 6))], [meta("w", (4, 6), (2, 0), (2, 6))]]
    dst = [[meta("w", (4, 6), (0, 0), (4, 3))], [meta("w", (4, 6), (0, 3), (4, 3))]]
    transfers = plan_transfers(src, dst)
    assert sorted((t.src, t.dst, t.src_box, t.dst_box) for t in transfers) == [
        (0, 0, Box((0, 0), (2, 3)), Box((0, 0), (2, 3))),
        (0, 1, Box((0, 3), (2, 3)), Box((0, 0), (2, 3))),
        (1, 0, Box((0, 0), (2, 3)), Box((2, 0), (2, 3))),
        (1, 1, Box((0, 3), (2, 3)), Box((2, 0), (2, 3))),
    ]


def test_name_on_destination_only_is_named():
    with pytest.raises(PlanError, match=r"1 destination tensor\(s\) have no source: extra.weight"):
        plan_transfers([[full("w", (2,))]], [[full("w", (2,)), full("extra.weight", (2,))]])


def test_name_on_source_only_is_named_unless_allowed():
    src = [[full("w", (2,)), full("rotary.inv_freq", (2,))]]
    with pytest.raises(PlanError, match=r"source tensor\(s\) have no destination: rotary.inv_freq"):
        plan_transfers(src, [[full("w", (2,))]])
    assert len(plan_transfers(src, [[full("w", (2,))]], allow_unused_sources=True)) == 1


def test_global_shape_disagreement_is_named():
    with pytest.raises(PlanError, match=r"shape mismatch in 1 tensor\(s\): w: source \(4, 6\) vs destination \(4, 8\)"):
        plan_transfers([[full("w", (4, 6))]], [[full("w", (4, 8))]])


def test_dtype_disagreement_casts_by_default_and_fails_when_strict():
    transfers = plan_transfers([[full("w", (4,), F32)]], [[full("w", (4,), BF16)]])
    assert transfers[0].dtype == BF16  # the wire carries the destination dtype: the sender casts
    with pytest.raises(PlanError,
                       match=r"dtype mismatch .* 'strict': w: source torch.float32 vs destination torch.bfloat16"):
        plan_transfers([[full("w", (4,), F32)]], [[full("w", (4,), BF16)]], cast="strict")


def test_uncovered_region_is_named():
    src = [[meta("w", (4, 2), (0, 0), (3, 2))]]
    with pytest.raises(PlanError,
                       match=r"w: 2 of 8 elements of box \[0:4, 0:2\] on gen rank 0 are held by no train rank"):
        plan_transfers(src, [[full("w", (4, 2))]])


def test_overlapping_destinations_are_named():
    dst = [[meta("w", (4,), (0,), (3,)), meta("w", (4,), (2,), (2,))]]
    with pytest.raises(PlanError, match=r"w: destination boxes \[0:3\] and \[2:4\] overlap on gen rank 0"):
        plan_transfers([[full("w", (4,))]], dst)


def test_partially_overlapping_sources_that_are_not_replicas_are_rejected():
    src = [[meta("w", (4,), (0,), (3,))], [meta("w", (4,), (2,), (2,))]]
    with pytest.raises(PlanError, match=r"w: source boxes \[0:3\] .* and \[2:4\] .* overlap without being replicas"):
        plan_transfers(src, [[full("w", (4,))]])


def test_ranks_of_one_side_disagreeing_on_a_tensor_are_named():
    with pytest.raises(PlanError, match=r"train ranks disagree on w: \(4,\) .* vs \(5,\)"):
        plan_transfers([[full("w", (4,))], [full("w", (5,))]], [[full("w", (4,))]])


def test_replicas_are_balanced_so_the_busiest_sender_sends_half():
    # Four data-parallel replicas of eight 1 MiB tensors; one destination wants everything.
    names = [f"layer{i}.weight" for i in range(8)]
    replica = [full(n, (256, 1024)) for n in names]
    src = [list(replica) for _ in range(4)]
    dst = [[full(n, (256, 1024)) for n in names]]
    schedule = build_schedule(plan_transfers(src, dst), 4, 1, 64 << 20)
    total = 8 * 256 * 1024 * 4
    assert schedule.summary.bytes == total
    assert schedule.summary.busiest_sender_bytes == total // 4


def test_big_replicated_tensor_is_split_across_replicas():
    src = [[full("embed", (1024, 1024))] for _ in range(2)]
    schedule = build_schedule(plan_transfers(src, [[full("embed", (1024, 1024))]]), 2, 1, 64 << 20)
    assert schedule.summary.busiest_sender_bytes == 1024 * 1024 * 4 // 2


_PLAN_IN_A_FRESH_PROCESS = """
import hashlib, torch
from refit_core import RefitOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, TensorSpec
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.reference import plan_transfers
from refit_core.plan.schedule import build_schedule

specs = [TensorSpec(f"model.layers.{i}.{name}", (64, 48), torch.float32)
         for i in range(6) for name in ("q.weight", "k.weight", "mlp.up.weight", "norm.weight")]
# 4 train ranks: two replicas of a row split (the planner picks a replica per region) ...
train = [[PieceMeta(s, Box((32 * (r % 2), 0), (32, 48))) for s in specs] for r in range(4)]
# ... into 2 engine replicas of a column split over 3 ranks (16 + 16 + 16), fed through a relay
gen = [[PieceMeta(s, Box((0, 16 * (r % 3)), (64, 16))) for s in specs] for r in range(6)]
options = RefitOptions(bucket_bytes=8 << 10, relay={"replicas": 2, "direct": 1}).resolved("cpu")
schedule, relay = plan_with_relay(train, gen, options)
reference = build_schedule(plan_transfers(train, gen), 4, 6, 8 << 10)
for s in (schedule, reference):
    print(s.fingerprint, hashlib.sha256(repr(s.rounds).encode()).hexdigest())
print(relay.digest)
"""


def test_plans_are_the_same_in_processes_with_different_hash_seeds():
    """Set and dict orders of strings change with ``PYTHONHASHSEED``: the fast planner (with relay)
    and the reference planner each give the same schedule, rounds and fingerprint in fresh processes."""
    import os
    import subprocess
    import sys

    outputs = []
    for seed in ("0", "1"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _PLAN_IN_A_FRESH_PROCESS], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert outputs[0].count("\n") == 3, outputs[0]
    assert outputs[1] == outputs[0], outputs
