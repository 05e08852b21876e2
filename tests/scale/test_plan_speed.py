"""Planning from metadata is fast and plans exactly what the reference planner plans.

The fingerprints below are golden values of the whole static plan: the transfers, cut into messages
and placed in rounds by ``refit_core.plan.schedule``, hashed with the options' digest. The commits that
changed the schedule (rounds filled by the ranks' remaining load, then paced rounds; sibling experts
that both backends hold grouped interleaved expert by expert) or the agreed settings' digest (the NCCL
communicators left to the plan, 2026-11-26) re-recorded them
from the production path (``plan_from_metadata``, whose planner is ``refit_core.plan.fast``).
``test_the_reference_planner_gives_the_recorded_fingerprint`` plans every case again with the reference
planner (``refit_core.plan.reference``) into the same schedule, so each value is also the reference
planner's, checked in every run (the two large cases take it about 0.4 and 5 s). The 1024-rank case
(``dtensor:fsdp=128,tp=8 -> vllm:tp=8``, 592,896 segments, ``b9026ffa40982d3a``) is too large for the
reference planner and is not run in CI: that value is the fast planner's alone (see
``benchmarks/plan_speed.py``). Timings are not asserted here (this machine is shared).
"""

from __future__ import annotations

import pytest

from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import load_config
from refit_core.plan.offline import plan_from_metadata
from refit_core.plan.reference import plan_transfers

RECORDED = [  # (model, train, gen, fingerprint, messages, segments)
    ("tiny-qwen3-moe", "dtensor:fsdp=2", "vllm:tp=2", "deb602fc1567afc5", 4, 140),
    ("tiny-llama", "dtensor:fsdp=2,tp=2", "vllm:tp=2,dp=2", "85a242b2891e43e8", 8, 168),
    ("tiny-mixtral", "dtensor:fsdp=2,tp=2", "vllm:tp=2,ep=2", "21c73feb80f5f853", 4, 92),
    ("tiny-qwen3-tied", "dtensor:fsdp=3", "vllm:tp=2,pp=2", "e168310f86b7d79c", 12, 126),
    ("tiny-qwen3-moe", "dtensor:dp=2,fsdp=2,tp=2", "dtensor:fsdp=4", "79e3cce3fcd0eed3", 16, 116),
    ("tiny-qwen3", "dtensor:fsdp=5,tp=2", "vllm:tp=4,dp=2", "65b2d72be7be8846", 60, 872),
]
LARGE = [
    ("llama-3-8b-shape", "dtensor:fsdp=8,tp=2", "vllm:tp=4,dp=2", "0249e98e13807f5e", 576, 13440),
    ("qwen3-30b-a3b-shape", "dtensor:fsdp=16,tp=8", "vllm:tp=8", "949538bb7b2cfa78", 1152, 215424),
]


def _plan(model: str, train: str, gen: str):
    train_backend, train_layout = parse_backend_layout(train)
    gen_backend, gen_layout = parse_backend_layout(gen)
    return plan_from_metadata(get_plugin_manager(), load_config(model), train_backend, train_layout,
                              gen_backend, gen_layout).schedule


@pytest.mark.parametrize(("model", "train", "gen", "fingerprint", "messages", "segments"), RECORDED,
                         ids=[f"{m}-{t}-{g}" for m, t, g, *_ in RECORDED])
def test_plan_keeps_the_recorded_fingerprint(model, train, gen, fingerprint, messages, segments) -> None:
    schedule = _plan(model, train, gen)
    assert (schedule.fingerprint, schedule.summary.messages, schedule.summary.segments) == (
        fingerprint, messages, segments)


@pytest.mark.parametrize(("model", "train", "gen", "fingerprint", "messages", "segments"),
                         RECORDED + [pytest.param(*case, marks=pytest.mark.slow) for case in LARGE],
                         ids=[f"{m}-{t}-{g}" for m, t, g, *_ in RECORDED + LARGE])
def test_the_reference_planner_gives_the_recorded_fingerprint(monkeypatch, model, train, gen, fingerprint, messages,
                                                               segments) -> None:
    """What the recorded values are checked against: the reference planner's transfers, scheduled the same way."""
    monkeypatch.setattr("refit_core.plan.planning.plan_transfers_fast", plan_transfers)
    schedule = _plan(model, train, gen)
    assert (schedule.fingerprint, schedule.summary.messages, schedule.summary.segments) == (
        fingerprint, messages, segments)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "train", "gen", "fingerprint", "messages", "segments"), LARGE,
                         ids=[f"{m}-{t}-{g}" for m, t, g, *_ in LARGE])
def test_large_plan_keeps_the_recorded_fingerprint(model, train, gen, fingerprint, messages, segments) -> None:
    schedule = _plan(model, train, gen)
    assert (schedule.fingerprint, schedule.summary.messages, schedule.summary.segments) == (
        fingerprint, messages, segments)
