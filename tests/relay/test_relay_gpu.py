"""The pipelined relay over NCCL: 1 trainer GPU -> a chain of 3 replicas on GPUs 1-3, in place and staged,
every replica bitwise, forwarding ordered by CUDA events (the step's CUDA timeline shows a replica forwarding
its first round before it received its last); and the relay by broadcast, NCCL's own. Skipped without 4 CUDA
GPUs (CI has none); ``benchmarks/run_gpu.sh`` runs it on nvidia-h200-x4."""

from __future__ import annotations

import pytest
import torch
from relay_ranks import relay_ranks
from tests.environments import BY_DESIGN

from refit_core.kit.launch import free_port, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                       reason=f"{BY_DESIGN}needs 4 CUDA GPUs"),
]

CHAIN = {"replicas": 3, "direct": 1}
SMALL = {"bucket_bytes": 1 << 12, "messages": {"direct_min_bytes": 1 << 11, "shared_max_bytes": 1 << 11}}


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_one_gpu_feeds_a_chain_of_three_replicas_over_nccl_bitwise(mode):
    results = spawn(relay_ranks, 4, f"127.0.0.1:{free_port()}", 3, CHAIN, None, 120.0, 1, 1,
                    {**SMALL, "mode": mode}, True, True, timeout_s=300)
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    trainer, gens = results[0], results[1:]
    for gen in gens:
        assert [s["mismatches"] for s in gen["steps"]] == [[], [], []]
        assert [s["engine_version"] for s in gen["steps"]] == [100, 101, 102]
    step_bytes = trainer["train_bytes"]
    assert trainer["counters"][-1]["sent_bytes"] == 3 * step_bytes
    assert [g["counters"][-1]["sent_bytes"] for g in gens] == [3 * step_bytes, 3 * step_bytes, 0]
    # on CUDA a round's forward shares an exchange with the next round's receives: the middle replica's
    # first forward starts before the exchange that receives the step's last round has ended
    spans = [s for s in gens[1]["timelines"][-1] if s[1] >= 0]
    last = max(r for _, r, _, _ in spans)
    last_received = min((start, end) for _, r, start, end in spans if r == last)[1]
    forwarded = [start for phase, _, start, _ in spans if phase == "forward"]
    assert last > 1 and forwarded and min(forwarded) < last_received, spans


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_one_gpu_broadcasts_each_message_to_three_replicas_over_nccl_bitwise(mode):
    """``RelayOptions.broadcast``: NCCL's own broadcasts; the trainer's GPU sends each byte once per step, and no
    replica sends any (NCCL forwards inside its kernels, which refit's counters do not see)."""
    results = spawn(relay_ranks, 4, f"127.0.0.1:{free_port()}", 3, {**CHAIN, "broadcast": True}, None, 120.0, 1, 1,
                    {**SMALL, "mode": mode}, True, True, timeout_s=300)
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    trainer, gens = results[0], results[1:]
    for gen in gens:
        assert [s["mismatches"] for s in gen["steps"]] == [[], [], []]
        assert [s["engine_version"] for s in gen["steps"]] == [100, 101, 102]
    step_bytes = trainer["train_bytes"]
    assert trainer["counters"][-1]["sent_bytes"] == 3 * step_bytes
    assert [g["counters"][-1]["received_bytes"] for g in gens] == [3 * step_bytes] * 3
    assert [g["counters"][-1]["sent_bytes"] for g in gens] == [0, 0, 0]
