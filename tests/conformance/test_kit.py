"""The conformance kit itself: each check fails, naming the fault, on a plugin that has it.

A kit whose checks cannot fail proves nothing; ``broken_plugins.py`` breaks the contract on purpose.
"""

from __future__ import annotations

from dataclasses import replace

import broken_plugins
import torch

from refit_core import ParallelLayout, RefitOptions, get_plugin_manager
from refit_core.apps import same_bytes
from refit_core.kit.models import PRESETS, reference_state_dict
from refit_core.plan.offline import plan_from_metadata
from refit_core.kit.verify import mismatches, reference_region
from refit_core import Side
from refit_core.testing import ModelCase
from refit_core.testing.live import round_trip
from refit_core.testing.reference import reference_weights
from refit_core.testing.results import Outcome
from refit_core.testing.static import model_free_checks
from refit_core.testing.live import loader_differences
from refit_core.testing.static import kit_manager
from refit_core.testing.suite import RankContext
from refit_core.testing.memory import overlapping_views, uncovered


def _by_name(results):
    return {r.name: r for r in results}


def test_model_free_checks_name_every_fault_of_a_greedy_plugin():
    results = _by_name(model_free_checks(broken_plugins.GREEDY))
    assert results["registration"].outcome is Outcome.PASSED
    foreign = results["hooks answer None for foreign models and backends"]
    assert foreign.outcome is Outcome.FAILED
    assert any("refit_destination_map claims a foreign builtins.object" in p for p in foreign.problems)
    assert any("refit_testing" not in p and "ReferenceEngine" in p for p in foreign.problems)
    train = results["train layout toy dp=2"]
    assert train.outcome is Outcome.FAILED and "PlanError" in train.problems[0]
    # the last train rank's experts are missing: the grouped tensor comes out too short
    assert "model.layers.0.mlp.experts.up_proj.weight: source (2, 8, 32) vs destination (4, 8, 32)" in train.problems[0]
    gen = results["gen layout toy dp=2"]
    assert gen.outcome is Outcome.FAILED and "overlap on gen rank 0" in gen.problems[0]
    refusal = results["refuses train layout 'tp=2'"]
    assert refusal.outcome is Outcome.FAILED and refusal.problems == ("raised ValueError instead of PluginError: tp",)


def test_round_trip_catches_reordered_pieces_and_a_false_abort():
    """A gen plugin whose live pieces come in another order than its metadata (so its live plan is
    not ``refit plan``'s either), and whose abort claims to restore but does not: those checks
    fail, everything else passes."""
    suite = broken_plugins.SLOPPY
    results = _by_name(round_trip(suite, suite.round_trips[0], Side.GEN, timeout_s=240))
    failed = sorted(name.split(": ", 1)[1] for name, r in results.items() if r.outcome is Outcome.FAILED)
    assert failed == ["abort_update restores the previous weights", "live pieces equal metadata-only pieces",
                      "live plan equals `refit plan` with default options"], results
    live = next(r for n, r in results.items() if n.endswith("live pieces equal metadata-only pieces"))
    assert live.problems[0].startswith("gen rank 0: piece 0: live model.norm.weight")
    abort = next(r for n, r in results.items() if n.endswith("abort_update restores the previous weights"))
    assert "after abort, differs from the previous weights" in abort.problems[0]
    assert sum(n.endswith("every destination byte equals the reference") for n in results) == 2


def test_overlapping_and_uncovered_views_are_named():
    base = torch.zeros(4, 6)
    views = [base[:2], base[1:3, 2:4], base[3:, :3]]
    assert overlapping_views(["a", "b", "c"], views) == ["a and b: their views share memory"]
    assert overlapping_views(["z"], [torch.zeros(()).expand(3)]) == [
        "z: its view addresses some bytes more than once (zero or overlapping strides)"]
    assert uncovered({"base": base}, views) == ["base: 7 of 24 elements are written by no destination view"]
    assert uncovered({"base": base}, [base[:2], base[2:]]) == []
    as_bytes = base.view(torch.uint8)[0, :4]  # another dtype over the same storage still overlaps
    assert overlapping_views(["f", "u"], [base[0, :1], as_bytes]) == ["f and u: their views share memory"]


def test_reference_weights_equal_the_core_reference_state_dict():
    config = dict(PRESETS["tiny-qwen3-moe"])
    ours, core = reference_weights(ModelCase.preset("tiny-qwen3-moe").specs(), 3, 1), reference_state_dict(config, 3, 1)
    assert ours.keys() == core.keys() and all(same_bytes(ours[k], core[k]) for k in core)


def test_refit_plan_defaults_to_a_live_refits_bucket():
    """The outside developer's "fingerprints differ unless you pass --bucket-mb 64": ``refit plan``'s
    default is now what a live refit on the same device takes."""
    pm = get_plugin_manager()
    config, layout = dict(PRESETS["tiny-llama"]), ParallelLayout(dp=2)
    cpu = plan_from_metadata(pm, config, "toy", layout, "toy", layout, device="cpu").schedule
    assert cpu.bucket_bytes == RefitOptions().resolved("cpu").bucket_bytes == 64 << 20
    cuda = plan_from_metadata(pm, config, "toy", layout, "toy", layout, device="cuda").schedule
    assert cuda.bucket_bytes == 512 << 20 and cuda.fingerprint != cpu.fingerprint



def test_only_the_loader_reference_sees_the_swapped_slices():
    """Written through its own (wrong) destination map, the swapped engine passes every check that
    goes through that map; the engine's own loader, filling a second model, differs in ``qkv`` only."""
    suite = broken_plugins.SWAPPED
    pm = kit_manager(suite, broken_plugins.MODEL)
    ctx = RankContext(0, 2, ParallelLayout(dp=2), {}, "tcp://127.0.0.1:1")
    model, twin = suite.gen.build(ctx), suite.gen.build(ctx)
    state = reference_weights(broken_plugins.MODEL.specs(), 5, 0)
    pieces = pm.destination_map(model).pieces
    for piece in pieces:
        piece.view.copy_(reference_region(piece, state))
    assert mismatches(pieces, state) == []
    assert loader_differences(pm, suite.gen, model, twin, state) == [
        "qkv: differs from the engine's own loader of the reference"]
    by_views = replace(suite.gen, parameters=None)  # no parameters: view by view, naming the pieces
    assert loader_differences(pm, by_views, model, twin, state) == [
        "model.layers.0.self_attn.k_proj.weight[0:16, 0:32]: differs from the engine's own loader of the reference",
        "model.layers.0.self_attn.v_proj.weight[0:16, 0:32]: differs from the engine's own loader of the reference"]
