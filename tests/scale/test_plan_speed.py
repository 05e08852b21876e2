"""Planning from metadata is fast and plans exactly what it planned before it was made fast.

The fingerprints below were recorded with the reference planner (``refit_core.plan.reference``) and the
schedule as they were before the array planner (``refit_core.plan.fast``), at 5505877 (the recorded
values of main 97f1027 had gone stale with later changes to the options' digest): the same input must
give the same schedule, segment for segment. The 1024-rank case (``dtensor:fsdp=128,tp=8 -> vllm:tp=8``,
592,896 segments) gave ``80108849a66db46b`` there and here; it is not run in CI (see
``benchmarks/plan_speed.py``). The two large cases were re-recorded when rounds began to be filled by
the ranks' remaining load (``schedule._place_in_rounds``): the same messages and segments, in other
rounds (the 1024-rank case was then ``0dc8c5ee463f59ec``), and again, with the tied-embedding case,
when rounds began to be paced (each pair its even share per round first): the same messages and
segments, in other rounds (the 1024-rank case is now ``2d75e7ca8b2b90cc``). Timings are not asserted here (this machine
is shared).
"""

from __future__ import annotations

import pytest

from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import load_config
from refit_core.plan.offline import plan_from_metadata

RECORDED = [  # (model, train, gen, fingerprint, messages, segments)
    ("tiny-qwen3-moe", "dtensor:fsdp=2", "vllm:tp=2", "12c525189932bc8e", 4, 92),
    ("tiny-llama", "dtensor:fsdp=2,tp=2", "vllm:tp=2,dp=2", "2c97fc393efd102f", 8, 168),
    ("tiny-mixtral", "dtensor:fsdp=2,tp=2", "vllm:tp=2,ep=2", "9f7354c22ea28502", 4, 92),
    ("tiny-qwen3-tied", "dtensor:fsdp=3", "vllm:tp=2,pp=2", "f612cf98979f0232", 12, 126),
    ("tiny-qwen3-moe", "dtensor:dp=2,fsdp=2,tp=2", "dtensor:fsdp=4", "bb4286d0fa3f801d", 16, 116),
    ("tiny-qwen3", "dtensor:fsdp=5,tp=2", "vllm:tp=4,dp=2", "e0874e9f50687839", 60, 872),
]
LARGE = [
    ("llama-3-8b-shape", "dtensor:fsdp=8,tp=2", "vllm:tp=4,dp=2", "9d88323546e18f6a", 576, 13440),
    ("qwen3-30b-a3b-shape", "dtensor:fsdp=16,tp=8", "vllm:tp=8", "2619493e617898b2", 1152, 215424),
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


@pytest.mark.slow
@pytest.mark.parametrize(("model", "train", "gen", "fingerprint", "messages", "segments"), LARGE,
                         ids=[f"{m}-{t}-{g}" for m, t, g, *_ in LARGE])
def test_large_plan_keeps_the_recorded_fingerprint(model, train, gen, fingerprint, messages, segments) -> None:
    schedule = _plan(model, train, gen)
    assert (schedule.fingerprint, schedule.summary.messages, schedule.summary.segments) == (
        fingerprint, messages, segments)
