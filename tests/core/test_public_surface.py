"""The declared public surface: pinned name by name, plugins import core names only from it, the guide lists it.

The surface is ``__all__`` of :mod:`refit_core` (users and plugins), :mod:`refit_core.kit` (engine and trainer
plugin authors' helpers), :mod:`refit_core.apps` (demo programs, ranks, reference weights, RL, Ray),
:mod:`refit_core.testing` (the conformance kits) and :mod:`refit_core.transports` (transport authors). Every
plugin in this repository (``plugins/*/refit_*``, the example ``refit_toy``) must stay within it; the 0.2 paths
and the names that left a public module's ``__all__`` keep importing, with a warning naming their new place.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ("refit_core", "refit_core.kit", "refit_core.apps", "refit_core.testing", "refit_core.transports")
PLUGIN_SOURCES = sorted(init.parent for init in ROOT.glob("plugins/*/refit_*/__init__.py")) + [
    ROOT / "tests/example_plugin/refit_toy"]
GUIDE = ROOT / "docs/writing-a-plugin.md"

SURFACE = {
    "refit_core": [
        "Backend", "Box", "DestinationMap", "DestinationPiece", "ExpertName", "LoraFactors", "LoraMerge", "LoraMode",
        "LoraSpec", "MergedSourcePiece", "OptionError", "ParallelLayout", "PlanError", "PluginError", "PluginManager",
        "Quantization", "RefitError", "RefitOptions", "RefitReceiver", "RefitSender", "Side", "SourcePiece",
        "StepFailedError", "TensorSpec", "TransferError", "adapter_tensor_names", "get_plugin_manager", "hookimpl"],
    "refit_core.kit": [
        "AdapterSlots", "EngineRank", "EngineRefusesError", "ModelPlan", "ModuleTensors", "PlannedPiece", "RankState",
        "SlotBox", "SlotPlan", "Suspect", "TensorSwap", "Trace", "WorkerReport", "checkpoint_specs", "config_dtype",
        "decoder_pieces", "engine_refusal", "gather_reports", "meta_copy", "own_rank_state", "plan_model",
        "refuse_engine", "refuse_serving", "resume_engine", "resume_serving", "safetensors_specs", "serving_verdict",
        "settle_serving", "trace_loads"],
    "refit_core.apps": [
        "DemoContext", "DemoPrograms", "DemoReport", "FleetStepError", "RayRefit", "RefitFleet", "RefitTrainActor",
        "Rollout", "completion_logprobs", "free_port", "join_fleet", "load_config", "mismatches", "quantized_reference",
        "reference_region", "reference_state_dict", "reference_tensor", "same_bytes", "send_versions", "spawn",
        "train_demo"],
    "refit_core.testing": [
        "Conformance", "GenFactory", "ModelCase", "PluginConformance", "RankContext", "Refusal", "RoundTrip",
        "TrainFactory", "check_plugin", "check_transport"],
    "refit_core.transports": [
        "DoneFence", "Fence", "PeerWatch", "Transport", "TransportContext", "TransportCounters", "TransportOptions",
        "TransportType", "check_contiguous", "register_transport", "spin_until"],
}
"""Every public name, by module: a name joins or leaves the surface here, on purpose, with the guide."""

SURFACE_CEILING = 99
"""The most names the five public modules may hold together (141 in three modules before the split; 96 before
the fleet's two entry points, ``RefitFleet`` and ``join_fleet``; 98 before ``FleetStepError``, which a training
loop under strict fleet membership catches).

Below this, every name is imported by a plugin of this repository or pinned by its tests (the engine-wide
serving verdict the vLLM and SGLang plugins re-export, the example plugin's imports), or is an entry point
of its own (the endpoints, the Ray driver, the transport registry)."""

BEFORE_THE_SPLIT = {
    "refit_core": (
        "AdapterFactors AdapterTensorName AuthenticationError BLOCK_SCALE_SUFFIX Backend Box CastPolicy DestinationMap "
        "DestinationPiece ExpertName FP8_DTYPES GEN LoraFactors LoraMerge LoraMode LoraSpec MergedSourcePiece "
        "MessageMode MessageOptions NcclBackend NcclOptions OptionError ParallelLayout PlanError PluginError "
        "PluginManager QuantScheme Quantization RefitError RefitOptions RefitReceiver RefitSender RelayOptions "
        "RendezvousError Side SourcePiece StepFailedError StepFailure StepStats TRAIN TensorSpec TransferError "
        "TransportKind UpdateMode adapter_tensor_names get_plugin_manager hookimpl"),
    "refit_core.kit": (
        "AdapterSlots BoxIndex DemoContext DemoProgram DemoPrograms DemoReport EngineRank EngineRefusesError Fill "
        "ModelInventory ModelPlan ModuleTensors PRESETS Phase Piece PlannedPiece ProgressLog RankFailure RankState "
        "RayRefit RefitReceiveActor RefitTrainActor Rollout SlotBox SlotPlan Suspect Target TensorSwap "
        "TornWeightsError Trace WorkerReport Write checkpoint_specs completion_logprobs config_dtype decoder_pieces "
        "engine_refusal first_overlap format_bytes format_duration free_port gather_reports head_dim load_config "
        "meta_copy mismatches model_inventory num_experts own_rank_state plan_model quantized_reference read_env "
        "reference_region reference_state_dict reference_tensor refuse_engine refuse_serving resume_engine "
        "resume_serving safetensors_specs same_bytes send_versions serving_verdict settle_serving spawn torn_tensors "
        "trace_loads train_demo transformers_config view_as_box"),
    "refit_core.testing": (
        "CheckResult Conformance ConformanceError GenFactory ModelCase Outcome PluginConformance REFERENCE_BACKEND "
        "RankContext ReferenceEngine ReferencePlugin ReferenceTrainer Refusal RoundTrip Side TrainFactory "
        "check_plugin installed_suite model_free_checks model_free_suite reference_weights require round_trip "
        "round_trips"),
}
"""``__all__`` of the three public modules before the split, as the plugin guide documented them then."""

LAZY = {"RayRefit", "RefitTrainActor"}
"""Names that need an optional dependency (Ray) to load."""


@dataclass(frozen=True)
class CoreImport:
    """One import of a core module in a plugin's source: where, which module, which names (None: the module)."""

    where: str
    module: str
    names: tuple[str, ...] | None


def _exported(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def _core_imports(path: Path, root: Path) -> list[CoreImport]:
    where = lambda node: f"{path.relative_to(root)}:{node.lineno}"  # noqa: E731
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "refit_core" or node.module.startswith("refit_core.")):
            found.append(CoreImport(where(node), node.module, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Import):
            found += [CoreImport(where(node), alias.name, None) for alias in node.names
                      if alias.name == "refit_core" or alias.name.startswith("refit_core.")]
    return found


def surface_violations(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``file:line: what`` (file relative to ``root``) for every import of a core module outside the surface,
    or of a name not in that module's ``__all__``."""
    exported = {module: _exported(module) for module in PUBLIC}
    problems = []
    for path in paths:
        for imp in _core_imports(path, root):
            if imp.module not in exported:
                problems.append(f"{imp.where}: imports {imp.module}, not a public module (use one of "
                                f"{', '.join(PUBLIC)})")
                continue
            for name in imp.names or ():
                if name not in exported[imp.module]:
                    problems.append(f"{imp.where}: imports {name} from {imp.module}, not in its __all__")
    return problems


def test_plugins_import_core_names_only_from_the_public_surface():
    paths = [path for root in PLUGIN_SOURCES for path in sorted(root.rglob("*.py"))]
    assert len(PLUGIN_SOURCES) == 6 and paths
    problems = surface_violations(paths)
    assert not problems, "plugins reach past the public surface:\n" + "\n".join(problems)


def test_the_check_names_file_and_line_of_an_import_past_the_surface(tmp_path):
    source = tmp_path / "plugin.py"
    source.write_text("from refit_core import Box\nfrom refit_core.contract.spec import TensorSpec\n"
                      "from refit_core.kit import not_a_helper\n\ndef f():\n    import refit_core.plan.fast\n")
    found = surface_violations([source], root=tmp_path)
    assert [p.split(": ", 1)[0] for p in found] == ["plugin.py:2", "plugin.py:3", "plugin.py:6"]
    elsewhere = ("not a public module (use one of refit_core, refit_core.kit, refit_core.apps, refit_core.testing, "
                 "refit_core.transports)")
    assert [p.split(": ", 1)[1] for p in found] == [f"imports refit_core.contract.spec, {elsewhere}",
                                                    "imports not_a_helper from refit_core.kit, not in its __all__",
                                                    f"imports refit_core.plan.fast, {elsewhere}"]


@pytest.mark.parametrize("module", PUBLIC)
def test_each_public_module_exports_exactly_its_pinned_names(module):
    names = importlib.import_module(module).__all__
    assert len(names) == len(set(names)), f"{module}.__all__ repeats a name"
    pinned = set(SURFACE[module])
    assert sorted(names) == SURFACE[module], (f"{module}.__all__ changed: added {sorted(set(names) - pinned)}, "
                                              f"removed {sorted(pinned - set(names))}")


def test_the_whole_surface_stays_under_its_ceiling():
    total = sum(len(names) for names in SURFACE.values())
    before = sum(len(names.split()) for names in BEFORE_THE_SPLIT.values())
    assert total <= SURFACE_CEILING < before, f"{total} public names: above {SURFACE_CEILING}"


AUTHORS_SURFACE = ("refit_core", "refit_core.kit", "refit_core.testing", "refit_core.transports")
"""What a backend or transport author needs (``refit_core.apps`` serves demos, Ray and RL loops)."""


def test_a_backend_or_transport_author_needs_fewer_than_80_names():
    total = sum(len(SURFACE[module]) for module in AUTHORS_SURFACE)
    assert total < 80, f"{total} names for plugin and transport authors"


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_imports(module):
    imported = importlib.import_module(module)
    for name in imported.__all__:
        if name in LAZY and importlib.util.find_spec("ray") is None:
            continue  # the Ray driver needs the optional dependency
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert getattr(imported, name) is not None, f"{module}.{name}"


@pytest.mark.parametrize("module", sorted(BEFORE_THE_SPLIT))
def test_every_name_documented_before_the_split_still_imports_and_warns_where_it_moved(module):
    imported = importlib.import_module(module)
    for name in BEFORE_THE_SPLIT[module].split():
        if name in LAZY | {"RefitReceiveActor"} and importlib.util.find_spec("ray") is None:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert getattr(imported, name) is not None, f"{module}.{name}"
        moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        if name in imported.__all__:
            assert not moved, (module, name, moved)
        else:
            assert moved and moved[0].startswith(f"{module}.{name} left the public surface: "), (module, name, moved)


NEW_IN_APPS = {"FleetStepError", "RefitFleet", "join_fleet"}
"""Names that came to ``refit_core.apps`` after the split: never in ``refit_core.kit``."""


def test_a_name_moved_to_apps_is_the_same_object_there():
    import refit_core.apps
    import refit_core.kit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in set(SURFACE["refit_core.apps"]) - LAZY - NEW_IN_APPS:
            assert getattr(refit_core.kit, name) is getattr(refit_core.apps, name), name


def test_an_unknown_name_is_an_attribute_error():
    import refit_core.kit

    with pytest.raises(AttributeError, match="no attribute 'not_a_helper'"):
        refit_core.kit.not_a_helper


def _listed(section: str) -> list[str]:
    """The names the guide lists under its heading ``### `section```, in order."""
    text = GUIDE.read_text()
    match = re.search(rf"^### `{re.escape(section)}`\n(.*?)(?=^#|\Z)", text, re.S | re.M)
    assert match, f"{GUIDE.name} has no section ### `{section}`"
    return re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", match.group(1))


@pytest.mark.parametrize("module", PUBLIC)
def test_the_plugin_guide_lists_exactly_the_public_surface(module):
    listed = _listed(module)
    assert len(listed) == len(set(listed)), f"{GUIDE.name} lists a name of {module} twice"
    assert sorted(listed) == sorted(_exported(module)), (
        f"{GUIDE.name} and {module}.__all__ differ: only in the guide {sorted(set(listed) - _exported(module))}, "
        f"only in __all__ {sorted(_exported(module) - set(listed))}")


OLD_PLUGIN = '''
"""A plugin module written against the refit 0.2 plugin guide."""
from refit_core.boxindex import BoxIndex, first_overlap
from refit_core.demo.context import DemoContext, DemoReport
from refit_core.env import read
from refit_core.experts import ExpertName
from refit_core.launch import free_port, spawn
from refit_core.models import checkpoint_specs, model_inventory, reference_state_dict
from refit_core.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.quant import Quantization
from refit_core.spec import Box, TensorSpec
from refit_core.verify import mismatches
'''

NEW_HOMES = {
    "refit_core": ["DestinationMap", "DestinationPiece", "SourcePiece", "Box", "TensorSpec", "ExpertName",
                   "Quantization"],
    "refit_core.kit": ["BoxIndex", "first_overlap", "DemoContext", "DemoReport", "free_port", "spawn",
                       "checkpoint_specs", "model_inventory", "reference_state_dict", "mismatches"],
}


def test_a_plugin_written_against_the_0_2_guide_still_imports_the_same_objects_and_warns(tmp_path):
    (tmp_path / "old_plugin.py").write_text(OLD_PLUGIN)
    probe = textwrap.dedent(f"""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import old_plugin
        import refit_core, refit_core.kit
        homes = {json.dumps(NEW_HOMES)}
        same = {{name: getattr(old_plugin, name) is getattr(getattr(refit_core, module.split(".")[1])
                                                             if "." in module else refit_core, name)
                 for module, names in homes.items() for name in names}}
        same["read"] = old_plugin.read is refit_core.kit.read_env
        print(json.dumps({{"same": same, "warnings": [str(w.message) for w in caught
                                                      if issubclass(w.category, DeprecationWarning)]}}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(result["same"].values()), {name: same for name, same in result["same"].items() if not same}
    moved = ["refit_core.boxindex", "refit_core.demo.context", "refit_core.env", "refit_core.experts",
             "refit_core.launch", "refit_core.models", "refit_core.pieces", "refit_core.quant", "refit_core.spec",
             "refit_core.verify"]
    for old in moved:
        assert any(w.startswith(f"{old} moved: ") for w in result["warnings"]), (old, result["warnings"])
