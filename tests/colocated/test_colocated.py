"""Colocated refits on CPU: shared-memory pairs and gloo pairs in one step, real processes, bitwise.

Every rank is its own process; ``host_id`` splits the one CI machine into "hosts", so a single refit
moves some pairs through shared memory (the receiver copies straight out of the trainer's memory)
and the others through gloo, as a colocated TP trainer and TP engine on several GPUs mix CUDA IPC
and NCCL. The layouts are the benchmark's Megatron-style trainer and vLLM-style engine (fused QKV,
``[gate; up]``, stacked experts) and the toy plugin's (per-expert names, replicas, bf16 casts).
"""

from __future__ import annotations

import time

import pytest
import torch
from colocated_ranks import bench_ranks, toy_ranks

from refit_core import RefitOptions
from refit_core.contract.errors import OptionError, PlanError
from refit_core.contract.options import Colocation
from refit_core.apps import same_bytes
from refit_core.kit.launch import free_port, spawn
from refit_core.plan.links import Link, Placement, choose_link, pair_links
from refit_core.run.copies import coalesce

SHARED = {"timeout_s": 20, "colocate": "shared"}


def _addresses() -> tuple[str, str]:
    return f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"


def _bench(model: str, train: int, hosts: list[str], steps: int = 3, fault: str | None = None, fault_rank: int = 0,
           options: dict | None = None):
    return spawn(bench_ranks, len(hosts), _addresses(), model, train, hosts, steps,
                 {**SHARED, "timeout_s": 10 if fault else 20, **(options or {})}, fault, fault_rank, timeout_s=240)


def _check_landed(results: list, steps: int) -> None:
    for r in results:
        assert isinstance(r, dict), r
        if r["side"] == "gen":
            assert [s["mismatches"] for s in r["steps"]] == [[]] * steps
            assert [s["version"] for s in r["steps"]] == [100 + i for i in range(steps)]
            assert [s["engine_version"] for s in r["steps"]] == [100 + i for i in range(steps)]


# -- the policy -------------------------------------------------------------------------------------

GPU0, GPU1 = "cuda:GPU-0", "cuda:GPU-1"


@pytest.mark.parametrize(("src", "dst", "colocation", "link"), [
    (Placement("a", GPU0), Placement("a", GPU0), Colocation.AUTO, Link.CUDA_IPC),
    (Placement("a", GPU0), Placement("a", GPU0), Colocation.SHARED, Link.CUDA_IPC),
    (Placement("a", GPU0), Placement("a", GPU1), Colocation.AUTO, Link.NETWORK),
    (Placement("a", GPU0), Placement("a", GPU1), Colocation.SHARED, Link.NETWORK),
    (Placement("a", "cpu"), Placement("a", "cpu"), Colocation.AUTO, Link.NETWORK),
    (Placement("a", "cpu"), Placement("a", "cpu"), Colocation.SHARED, Link.SHARED_MEMORY),
    (Placement("a", "cpu"), Placement("b", "cpu"), Colocation.SHARED, Link.NETWORK),
    (Placement("a", "cpu"), Placement("a", "cpu"), Colocation.OFF, Link.NETWORK),
])
def test_each_pair_gets_its_link(src, dst, colocation, link):
    assert choose_link(src, dst, colocation) is link


def test_a_same_gpu_pair_is_refused_only_when_colocation_is_off():
    train, gen = [Placement("a", GPU0), Placement("a", GPU1)], [Placement("a", GPU0), Placement("a", GPU1)]
    pairs = {(0, 0), (0, 1), (1, 0), (1, 1)}
    links = pair_links(pairs, train, gen, Colocation.AUTO)
    assert links == {(0, 0): Link.CUDA_IPC, (1, 1): Link.CUDA_IPC, (0, 1): Link.NETWORK, (1, 0): Link.NETWORK}
    with pytest.raises(PlanError, match=r"2 transfer\(s\) would connect two ranks on the same GPU "
                                        r"\(train 0 -> gen 0, train 1 -> gen 1\)"):
        pair_links(pairs, train, gen, Colocation.OFF)


def test_colocate_option_is_typed_and_checked():
    assert RefitOptions(colocate="shared").colocate is Colocation.SHARED
    assert RefitOptions().colocate is Colocation.AUTO
    with pytest.raises(OptionError, match=r"RefitOptions.colocate='everywhere': use one of 'auto', 'shared', 'off'"):
        RefitOptions(colocate="everywhere")


def test_copies_of_memory_neighbours_are_merged_and_others_kept():
    src, dst = torch.arange(24.0).view(4, 6), torch.zeros(4, 6)
    pairs = [(dst[0], src[0]), (dst[1], src[1]), (dst[2:], src[2:])]  # neighbours on both sides
    merged = coalesce(pairs)
    assert len(merged) == 1 and merged[0][0].shape == (24,)
    torch._foreach_copy_([d for d, _ in merged], [s for _, s in merged])
    assert same_bytes(dst, src)
    dst.zero_()
    columns = coalesce([(dst[:, 0], src[:, 0]), (dst[:, 1], src[:, 1]), (dst[:, 2], src[:, 3])])
    assert len(columns) == 2  # columns 0, 1 at a constant distance on both sides; 3 breaks the stride
    torch._foreach_copy_([d for d, _ in columns], [s for _, s in columns])
    assert same_bytes(dst[:, :3], src[:, [0, 1, 3]]) and not dst[:, 3:].any()
    shapes = coalesce([(dst[0, :2], src[0, :2]), (dst[1, :3], src[1, :3])])  # different shapes
    assert len(shapes) == 2


# -- real refits ----------------------------------------------------------------------------------

def test_dense_mixed_plan_is_bitwise_over_steps():
    """Megatron-style TP2 -> vLLM-style TP1: gen 0 reads train 0's memory (one host) and receives
    train 1's half over gloo in the same step, three steps, every byte checked."""
    results = _bench("tiny-llama", 2, ["A", "B", "A"])
    _check_landed(results, 3)
    assert results[0]["links"] == ["shared-memory"] and results[1]["links"] == ["network"]
    assert results[2]["links"] == ["network", "shared-memory"]
    assert results[0]["shared_storage"] is True  # the trainer's parameters now live in shared memory
    assert [s["staging"] for s in results[0]["steps"]] == [0, 0, 0]  # the colocated trainer packs nothing
    counts = results[2]["copy_counts"]  # per layer: q, k, v (each stacked over groups), o, gate_up, down
    assert counts.strided > 0 and counts.copies < counts.segments


def test_moe_mixed_plan_is_bitwise_over_steps():
    """Qwen3-MoE shapes, Megatron-style TP1 -> vLLM-style TP2: train 0 feeds gen 0 through shared
    memory and gen 1 over gloo in one step (stacked experts, fused QKV), three steps, bitwise."""
    results = _bench("tiny-qwen3-moe", 1, ["A", "A", "B"])
    _check_landed(results, 3)
    assert results[0]["links"] == ["network", "shared-memory"]
    assert results[1]["links"] == ["shared-memory"] and results[2]["links"] == ["network"]
    colocated_gen = results[1]["steps"][0]
    assert colocated_gen["staging"] == 0  # nothing staged: copied straight out of the trainer's memory
    counts = results[1]["copy_counts"]  # TP1 -> TP2: w13's gate / up rows are two equal strided blocks
    layers = 2
    assert counts.copies < counts.segments and counts.launches <= 9 * layers + 3, counts


def test_toy_plugin_mixed_plan_with_experts_replicas_and_casts():
    """The toy plugin (per-expert names, replicated norm, bf16 destination cast) over 2 -> 3 ranks,
    hosts A B | A B A: shared-memory and gloo pairs in every step."""
    hosts = ["A", "B", "A", "B", "A"]
    results = spawn(toy_ranks, 5, _addresses(), 2, hosts, 2, SHARED, timeout_s=240)
    for r in results:
        assert isinstance(r, dict), r
    links = set().union(*(r["links"] for r in results))
    assert links == {"network", "shared-memory"}
    for r in results[2:]:
        assert [s["mismatches"] for s in r["steps"]] == [[], []]
        assert [s["version"] for s in r["steps"]] == [0, 1]


@pytest.mark.parametrize(("fault", "expected"), [
    ("free", "the memory of source tensor model.layers.0.self_attn.o_proj.weight was freed since setup"),
    ("realloc", "source tensor decoder.layers.0.self_attention.linear_proj.weight now lives at a "
                "different address than at setup"),
])
def test_a_trainer_that_frees_or_replaces_a_shared_parameter_gets_a_clear_error(fault, expected):
    """Train rank 1, checking before *ready* (``overlap_check=False``), breaks the contract before step 1:
    it and gen rank 0, which reads its memory, fail that step naming the tensor (never garbage) before
    any copy, while gen rank 0 also had a gloo peer (train 0)."""
    start = time.monotonic()
    results = _bench("tiny-llama", 2, ["A", "B", "B"], steps=2, fault=fault, fault_rank=1,
                     options={"overlap_check": False})
    train0, train1, gen0 = results
    assert train1[:2] == ("error", "TransferError") and expected in train1[2], train1
    assert gen0[:2] == ("error", "StepFailedError") and expected in gen0[2], gen0
    assert "train rank 1 failed colocated step 1" in gen0[2]
    # gen rank 0 fails step 1 before it posts train 0's gloo receives, so train 0's send cannot complete
    assert isinstance(train0, tuple) and train0[:2] == ("error", "TransferError"), train0
    assert "between rank 0 and rank 2 failed" in train0[2], train0
    assert time.monotonic() - start < 200


def test_a_check_that_overlaps_the_copies_still_fails_the_step_and_says_torn():
    """``overlap_check`` (the default): train rank 1 posts *ready* before checking its memory; the replaced parameter
    is still found, both sides fail step 1 naming it, and the engine reports its weights torn. The
    steps before it land bitwise."""
    expected = "source tensor decoder.layers.0.self_attention.linear_proj.weight now lives at a different address"
    results = _bench("tiny-llama", 2, ["A", "B", "B"], steps=2, fault="realloc", fault_rank=1,
                     options={"overlap_check": True, "strided_copies": "foreach"})
    _, train1, gen0 = results
    assert train1[:2] == ("error", "TransferError") and expected in train1[2], train1
    assert gen0[:2] == ("error", "StepFailedError") and expected in gen0[2], gen0
    assert "train rank 1 failed colocated step 1 after the copies had started" in gen0[2]
    assert "partly written (torn)" in gen0[2], gen0


def test_an_overlapping_check_lands_every_step_bitwise():
    _check_landed(_bench("tiny-llama", 1, ["A", "A"], steps=3, options={"overlap_check": True}), 3)


def test_equal_blocks_at_constant_distances_become_one_strided_copy():
    """Megatron's per-group [q_g; k_g; v_g] rows into vLLM's [Q; K; V]: one copy for all q blocks."""
    groups, q, kv, hidden = 4, 6, 2, 8
    src = torch.randn(groups * (q + 2 * kv), hidden)
    dst = torch.zeros_like(src)
    per = src.view(groups, q + 2 * kv, hidden)
    pairs = [(dst[g * q:(g + 1) * q], per[g, :q]) for g in range(groups)]
    pairs += [(dst[groups * q + g * kv: groups * q + (g + 1) * kv], per[g, q:q + kv]) for g in range(groups)]
    v_rows = groups * (q + kv)
    pairs += [(dst[v_rows + g * kv: v_rows + (g + 1) * kv], per[g, q + kv:]) for g in range(groups)]
    merged = coalesce(pairs)
    assert len(merged) == 3
    torch._foreach_copy_([d for d, _ in merged], [s for _, s in merged])
    expected = torch.cat([per[:, :q].reshape(-1, hidden), per[:, q:q + kv].reshape(-1, hidden),
                          per[:, q + kv:].reshape(-1, hidden)])
    assert same_bytes(dst, expected)
