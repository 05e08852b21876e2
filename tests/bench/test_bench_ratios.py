"""The benchmarks' honesty checks on CPU, no GPU (issue #30): one validity check for every printed ratio,
a multi-rank wire that moves refit's bytes over refit's pairs, and shapes sliced to fit the card."""

from __future__ import annotations

import pytest

from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import load_config
from refit_core.plan.offline import plan_from_metadata
from refit_core.tools.bench.colocated import MEMORY_RESERVE, fit_model, needed_bytes
from refit_core.tools.bench.fit import model_bytes
from refit_core.tools.bench.runner import wire_after_refit, wire_ratio
from refit_core.tools.bench.validity import Ratio, bound_rate_problem, check_ratio, nominal_copy_gbps
from refit_core.tools.bench.wireplan import WirePlan, schedule_plan

GiB = 1 << 30
LLAMA_BYTES = 16_060_522_496  # llama-3-8b-shape


def test_a_ratio_above_its_bound_prints_invalid_with_the_reason_never_as_a_number():
    assert check_ratio(0.845, "copy bound") == Ratio(0.845) and check_ratio(0.845, "copy bound").text() == "0.845"
    assert check_ratio(1.015, "copy bound").valid  # within the measurement tolerance
    over = check_ratio(1.763, "wire moving the same bytes")
    assert not over.valid and over.text().startswith("INVALID (1.763 of the wire moving the same bytes")
    assert "1.763" not in over.text().split("(", 1)[0]
    assert not check_ratio(float("nan"), "wire").valid
    flagged = check_ratio(0.5, "copy bound", "copy bound timed cold")
    assert not flagged.valid and flagged.text() == "INVALID (copy bound timed cold)"
    assert flagged.as_json() == {"value": 0.5, "valid": False, "reason": "copy bound timed cold"}


def test_a_copy_bound_far_from_the_devices_rate_is_implausible():
    # issue #30: on a cold H100 the Llama shape's copy took 28.8 ms (557 GB/s), warm 10.71 ms (1,500 GB/s)
    cold = bound_rate_problem(LLAMA_BYTES, 28.8e-3, "NVIDIA H100 80GB HBM3")
    assert cold is not None and "timed cold" in cold
    assert bound_rate_problem(LLAMA_BYTES, 10.71e-3, "NVIDIA H100 80GB HBM3") is None
    assert bound_rate_problem(LLAMA_BYTES, 7.59e-3, "NVIDIA H200") is None  # 2,115 GB/s, committed H200 runs
    too_fast = bound_rate_problem(LLAMA_BYTES, 2e-3, "NVIDIA H200")  # 8 TB/s of copy: beyond the memory
    assert too_fast is not None and "exceeds" in too_fast
    assert nominal_copy_gbps("NVIDIA H100 PCIe") == 1000.0 and nominal_copy_gbps("cpu") is None
    assert bound_rate_problem(LLAMA_BYTES, 1.0, "cpu") is None  # unknown devices are not judged
    # a valid ratio over an implausible bound is still not a result
    assert not check_ratio(0.9, "copy bound", cold).valid


def _row(method: str, seconds: float, nbytes: int, info: dict | None = None) -> dict:
    return {"method": method, "time_s": seconds, "bytes": nbytes, "info": info or {}}


def test_x_wire_is_a_time_ratio_only_on_the_same_bytes():
    wire = _row("wire", 0.0219, 32_121_044_992)
    assert wire_ratio(_row("refit", 0.0249, 32_121_044_992), wire).value == pytest.approx(0.0219 / 0.0249)
    # the old h200x4 figure: refit's four pairs against a wire over one pair's shard
    one_pair = _row("wire", 0.0219, 8_030_527_488)
    unlike = wire_ratio(_row("refit", 0.0497, 32_121_044_992), one_pair)
    assert not unlike.valid and "not the same bytes" in unlike.text()
    assert not wire_ratio(_row("refit", 0.0100, 32_121_044_992), wire).valid  # beats the wire: impossible
    skipped = _row("wire", 0.02, 100, {"wire_skipped_pairs": [(0, 2)]})
    assert not wire_ratio(_row("refit", 0.04, 100), skipped).valid


def test_the_multi_rank_wire_moves_refits_bytes_over_refits_pairs():
    """The wire plan read off a real plan (FSDP 2 -> TP 2, tiny-llama) sums to the bytes the gen ranks hold."""
    pm = get_plugin_manager()
    config = load_config("tiny-llama")
    train, train_layout = parse_backend_layout("dtensor:fsdp=2")
    gen, gen_layout = parse_backend_layout("dtensor:tp=2")
    schedule = plan_from_metadata(pm, config, train, train_layout, gen, gen_layout).schedule
    plan = schedule_plan(schedule, num_train=2)
    held = 0
    for r in range(gen_layout.world_size):
        mapping = pm.destination_layout(gen, config, gen_layout, r)
        held += sum(p.meta.box.numel * p.meta.spec.dtype.itemsize for p in mapping.pieces)
        held += sum(s.nbytes for s in mapping.loader)
    assert plan.nbytes == held == schedule.summary.bytes
    assert {(p.src, p.dst) for p in plan.pairs} == {(0, 2), (0, 3), (1, 2), (1, 3)}  # every train -> gen pair
    assert list(plan.pairs) == sorted(plan.pairs, key=lambda p: (p.src, p.dst))  # one order on every rank
    assert plan.of_rank(2) == tuple(p for p in plan.pairs if p.dst == 2)
    assert WirePlan.from_json(plan.to_json()) == plan


def test_a_multi_rank_wire_runs_after_the_refit_it_copies():
    assert wire_after_refit(["wire", "refit", "refit@comms=1"]) == ["refit", "wire", "refit@comms=1"]
    assert wire_after_refit(["refit@zero_copy=0", "wire@ops=4"]) == ["refit@zero_copy=0", "wire@ops=4"]
    with pytest.raises(SystemExit, match="add a refit method"):
        wire_after_refit(["wire"])


def test_a_shape_too_large_for_the_card_runs_as_a_slice_of_its_layers():
    config = load_config("qwen3-30b-a3b-shape")
    bound = 4 * GiB
    h100 = 80 * GiB - MEMORY_RESERVE
    fit = fit_model("qwen3-30b-a3b-shape", config, h100, bound)
    assert fit.sliced and 0 < fit.layers < fit.total_layers == 48
    assert needed_bytes(model_bytes(config, fit.layers), bound) <= h100 < needed_bytes(
        model_bytes(config, fit.layers + 1), bound)  # the most layers that fit
    assert fit.label == f"qwen3-30b-a3b-shape[{fit.layers}/48 layers]"
    assert fit.config(config)["num_hidden_layers"] == fit.layers and config["num_hidden_layers"] == 48
    whole = fit_model("qwen3-30b-a3b-shape", config, 141 * GiB - MEMORY_RESERVE, bound)
    assert not whole.sliced and whole.label == "qwen3-30b-a3b-shape"  # an H200 holds it whole
    assert not fit_model("llama-3-8b-shape", load_config("llama-3-8b-shape"), h100, bound).sliced
    assert fit_model("x", config, None, bound).layers == 48  # no budget (CPU): whole
    skipped = fit_model("qwen3-30b-a3b-shape", config, 4 * GiB, bound)
    assert skipped.skipped and skipped.reason.startswith("skipped qwen3-30b-a3b-shape: even one layer needs")
