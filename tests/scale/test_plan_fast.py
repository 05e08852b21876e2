"""The array planner (``refit_core.plan.fast``) plans exactly what the reference planner plans.

Every case compares the two transfer lists element by element (same order, same sources, same
boxes) and the schedules' fingerprints, on real layouts of the plugins (DTensor, Megatron with DP
replicas, EP and MLA, vLLM with DP and EP), on topology-aware replica choice, and on the errors.
The 1024-rank and DeepSeek-V3 / Kimi-K2 cases are too slow for the reference planner in CI; their
fingerprints are pinned in ``tests/scale/test_plan_speed.py`` and timed by ``benchmarks/plan_speed.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refit_core.contract.errors import PlanError
from refit_core.contract.experts import group_side
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.pieces import DestinationPiece, PieceMeta
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import load_config
from refit_core.plan.fast import plan_transfers_fast
from refit_core.plan.reference import plan_transfers
from refit_core.plan.schedule import build_schedule
from refit_core.plan.simulate import GpuPlacement, Topology

Metas = list[list[PieceMeta]]


def _side_metas(backend_layout: str, config: dict[str, Any], train: bool) -> Metas:
    pm = get_plugin_manager()
    backend, layout = parse_backend_layout(backend_layout)
    ranks: Metas = []
    for r in range(layout.world_size):
        if train:
            ranks.append([p.meta for p in pm.source_layout(backend, config, layout, r)])
        else:
            mapping = pm.destination_layout(backend, config, layout, r)
            ranks.append([p.meta for p in mapping.pieces] + [DestinationPiece(s, s.full_box()).meta
                                                             for s in mapping.loader])
    return group_side(ranks, pm.expert_name).metas


def _row_split(src: Metas, parts: int) -> Metas:
    """A destination of ``parts`` ranks, each holding an even row block of every tensor (whole if uneven)."""
    specs = {m.spec.name: m.spec for metas in src for m in metas}
    out: Metas = []
    for r in range(parts):
        metas = []
        for spec in specs.values():
            rows = spec.shape[0] // parts
            if spec.shape[0] % parts or len(spec.shape) == 1:
                metas.append(PieceMeta(spec, spec.full_box()))
            else:
                metas.append(PieceMeta(spec, Box((r * rows, *(0,) * (len(spec.shape) - 1)), (rows, *spec.shape[1:]))))
        out.append(metas)
    return out


def _assert_same_plan(src: Metas, dst: Metas, **kwargs: Any) -> None:
    reference = plan_transfers(src, dst, **kwargs)
    fast = plan_transfers_fast(src, dst, **kwargs)
    assert len(fast) == len(reference)
    assert fast == reference
    a = build_schedule(reference, len(src), len(dst), 1 << 20)
    b = build_schedule(fast, len(src), len(dst), 1 << 20)
    assert (b.fingerprint, b.summary) == (a.fingerprint, a.summary)


PLUGIN_CASES = [  # (model, train, gen)
    ("tiny-llama", "dtensor:fsdp=2,tp=2", "vllm:tp=2,dp=2"),
    ("tiny-qwen3-moe", "dtensor:dp=2,fsdp=2,tp=2", "dtensor:fsdp=4"),
    ("tiny-mixtral", "dtensor:fsdp=2,tp=2", "vllm:tp=2,ep=2"),
    ("tiny-qwen3-tied", "dtensor:fsdp=3", "vllm:tp=2,pp=2"),
    ("tiny-qwen3", "dtensor:fsdp=5,tp=2", "vllm:tp=4,dp=2"),
    ("tiny-qwen3-moe", "megatron:tp=2,dp=4,ep=4", "vllm:tp=2,dp=2,ep=4"),
    ("tiny-qwen3-moe", "megatron:tp=2,pp=2,dp=2,ep=2", "vllm:tp=4"),
    ("llama-3-8b-shape", "dtensor:fsdp=8,tp=2", "vllm:tp=4,dp=2"),  # the mid-size case: 13,440 transfers
]


@pytest.mark.parametrize(("model", "train", "gen"), PLUGIN_CASES, ids=[" ".join(c) for c in PLUGIN_CASES])
def test_fast_planner_equals_reference_on_plugin_layouts(model: str, train: str, gen: str) -> None:
    config = load_config(model)
    _assert_same_plan(_side_metas(train, config, True), _side_metas(gen, config, False))


def test_fast_planner_equals_reference_on_mla_with_replicas_and_experts() -> None:
    from refit_megatron.conformance import MLA_CONFIG  # a tiny DeepSeek-V3: MLA, routed + shared experts, MTP

    src = _side_metas("megatron:tp=2,dp=4,ep=2", MLA_CONFIG, True)  # DP replicas of everything but experts
    _assert_same_plan(src, _row_split(src, 3))
    _assert_same_plan(src, _row_split(src, 2), balance_split_bytes=1 << 10)  # replicated regions cut in slabs


def test_fast_planner_equals_reference_on_uneven_pipeline_stages() -> None:
    """Megatron's uneven pipeline (1 + 3 layers over PP2) with DP replicas into vLLM TP x DP (engine replicas)."""
    from refit_megatron.conformance import MLA_CONFIG

    src = _side_metas("megatron:pp=2,pp_first=1,pp_last=3,dp=2,ep=2", MLA_CONFIG, True)
    _assert_same_plan(src, _side_metas("vllm:tp=2,dp=2,ep=4", MLA_CONFIG, False), allow_unused_sources=True,
                      balance_split_bytes=1 << 10)


@pytest.mark.parametrize(("readers", "slabs"), [(1, 4), (2, 2), (3, 2), (4, 1), (8, 1)])
def test_replicated_region_is_cut_for_its_readers_not_per_reader_and_replica(readers: int, slabs: int) -> None:
    """A large region held by 4 replicas: ``ceil(4 / readers)`` slabs per reader, so every replica
    sends a share, and the rows grow with replicas + readers (not their product)."""
    spec = TensorSpec("w", (64, 4096), torch.float32)  # 1 MiB
    src = [[PieceMeta(spec, spec.full_box())] for _ in range(4)]
    dst = [[PieceMeta(spec, spec.full_box())] for _ in range(readers)]
    transfers = plan_transfers(src, dst)
    assert len(transfers) == readers * slabs
    assert {t.src for t in transfers} == set(range(min(4, readers * slabs)))
    _assert_same_plan(src, dst)


@pytest.mark.parametrize("split", [1 << 30, 1 << 12])
def test_fast_planner_equals_reference_with_topology_distance(split: int) -> None:
    spec = TensorSpec("w", (64, 1024), torch.float32)
    bias = TensorSpec("b", (64,), torch.float32)
    rows = 16
    # four DP replicas of a 4-way row sharding (16 train ranks over 2 nodes), 6 gen ranks
    src = [[PieceMeta(spec, Box((s * rows, 0), (rows, 1024))), PieceMeta(bias, bias.full_box())]
           for _ in range(4) for s in range(4)]
    dst = [[PieceMeta(spec, Box((r * 32 % 64, 0), (32, 1024))), PieceMeta(bias, bias.full_box())] for r in range(6)]
    topology = Topology(gpus_per_node=8, latency_us=0.0)
    placement = GpuPlacement(train=tuple(range(16)), gen=(16, 17, 18, 3, 9, 12))
    _assert_same_plan(src, dst, distance=placement.distance(topology), balance_split_bytes=split)
    _assert_same_plan(src, dst, balance_split_bytes=split)


def _full(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> PieceMeta:
    spec = TensorSpec(name, shape, dtype)
    return PieceMeta(spec, spec.full_box())


def _rows(name: str, shape: tuple[int, ...], start: int, stop: int) -> PieceMeta:
    return PieceMeta(TensorSpec(name, shape, torch.float32), Box((start, 0), (stop - start, shape[1])))


ERROR_CASES = {
    "no source": ([[_full("w", (2, 2))]], [[_full("w", (2, 2)), _full("extra", (2, 2))]]),
    "no destination": ([[_full("w", (2, 2)), _full("extra", (2, 2))]], [[_full("w", (2, 2))]]),
    "shape": ([[_full("w", (4, 6))]], [[_full("w", (4, 8))]]),
    "ranks disagree": ([[_full("w", (4, 2))], [_full("w", (5, 2))]], [[_full("w", (4, 2))]]),
    "source overlap": ([[_rows("w", (4, 2), 0, 3)], [_rows("w", (4, 2), 2, 4)]], [[_full("w", (4, 2))]]),
    "hole": ([[_rows("w", (4, 2), 0, 2)]], [[_full("w", (4, 2))]]),
    "destination overlap": ([[_full("w", (4, 2))]], [[_rows("w", (4, 2), 0, 3), _rows("w", (4, 2), 2, 4)]]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_fast_planner_raises_the_reference_error(case: str) -> None:
    src, dst = ERROR_CASES[case]
    with pytest.raises(PlanError) as reference:
        plan_transfers(src, dst)
    with pytest.raises(PlanError) as fast:
        plan_transfers_fast(src, dst)
    assert str(fast.value) == str(reference.value)


def test_deepseek_v3_plans_from_megatron_into_vllm() -> None:
    """MLA's up-projections are split by heads on the engine, routed experts in EP blocks; the
    multi-token-prediction layer has no engine destination (allowed as an unused source)."""
    from refit_megatron.conformance import MLA_CONFIG

    src = _side_metas("megatron:tp=2,dp=2,ep=2", MLA_CONFIG, True)
    dst = _side_metas("vllm:tp=2,ep=2", MLA_CONFIG, False)
    by_name = {m.spec.name: m for m in dst[1]}
    q_b = by_name["model.layers.0.self_attn.q_b_proj.weight"]
    assert q_b.box.offsets[0] == q_b.spec.shape[0] // 2 and q_b.box.sizes[0] == q_b.spec.shape[0] // 2
    experts = [m for m in dst[1] if m.spec.name.endswith("mlp.experts.gate_proj.weight")]
    assert experts and all(m.box.offsets[0] == m.spec.shape[0] // 2 for m in experts)
    _assert_same_plan(src, dst, allow_unused_sources=True)
