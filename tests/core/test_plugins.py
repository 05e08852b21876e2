"""Plugin discovery through the `refit` entry-point group, selection by environment, clear errors."""

import importlib.metadata
import subprocess
import sys

import pytest

from refit_core import Backend, DestinationMap, PluginError, Side, hookimpl
from refit_core.contract.plugins import PLUGINS_ENV, PluginManager
from refit_core.apps import DemoPrograms, same_bytes


def refit(*args, env=None):
    import os
    return subprocess.run([sys.executable, "-m", "refit_core", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_example_plugin_is_installed_through_its_entry_point():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="refit")}
    assert eps["toy"].value == "refit_toy.plugin" and eps["toy"].dist.name == "refit-plugin-toy"
    pm = PluginManager()
    info = next(p for p in pm.plugins if p.name == "toy")
    assert (info.distribution, info.version) == ("refit-plugin-toy", "0.1.0")
    assert [b.name for b in info.backends] == ["toy"]


def test_refit_plugins_lists_name_distribution_version_and_sides():
    out = refit("plugins")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("toy "))
    assert line.split() == ["toy", "refit-plugin-toy", "0.1.0", "toy", "(gen+train)"]


def test_environment_variable_restricts_loaded_plugins(monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, "")
    assert PluginManager().plugins == []
    monkeypatch.setenv(PLUGINS_ENV, "toy")
    assert [p.name for p in PluginManager().plugins] == ["toy"]


def test_unrecognized_model_error_names_the_installed_plugins():
    with pytest.raises(PluginError, match=r"no installed refit plugin recognizes the training model of type "
                                          r"builtins.dict \(installed plugins: .*toy \(refit-plugin-toy\)"):
        PluginManager().source_pieces({})


def test_unknown_backend_error_lists_the_installed_ones():
    with pytest.raises(PluginError, match=r"no installed plugin provides a gen backend named 'nope' "
                                          r"\(installed gen backends: .*toy"):
        PluginManager().backend("nope", "gen")


class InCodePlugin:
    """A plugin registered in code rather than by entry point."""

    @hookimpl
    def refit_register_backends(self, register):
        register(Backend("incode", {"gen"}))

    @hookimpl
    def refit_destination_map(self, model):
        return DestinationMap([]) if model == "mine" else None


def test_plugins_registered_in_code_select_themselves_by_model():
    pm = PluginManager(load_entry_points=False)
    pm.register(InCodePlugin(), name="incode")
    assert pm.destination_map("mine").pieces == []
    assert [b.name for b in pm.backends("gen")] == ["incode"]
    with pytest.raises(PluginError, match="installed plugins: incode"):
        pm.destination_map("someone else's")


def test_loader_tensors_reach_the_engine_under_checkpoint_names():
    import torch

    pm = PluginManager(load_entry_points=False)
    grouped = torch.arange(24.).view(2, 3, 4)
    out = dict(pm.expert_naming().ungrouped([("l.experts.up_proj.weight", grouped),
                                             ("l.experts.3.w1.weight", torch.ones(3, 4)),
                                             ("l.q_proj.weight", torch.zeros(2))]))
    assert sorted(out) == ["l.experts.0.up_proj.weight", "l.experts.1.up_proj.weight", "l.experts.3.w1.weight",
                           "l.q_proj.weight"]
    assert same_bytes(out["l.experts.1.up_proj.weight"], grouped[1])
    assert out["l.experts.3.w1.weight"].shape == (3, 4)


def test_a_backend_is_only_the_contract_and_its_sides_are_sides():
    backend = Backend("b", {"train", "gen"}, "a backend")
    assert backend.sides == frozenset({Side.TRAIN, Side.GEN}) and all(isinstance(s, Side) for s in backend.sides)
    with pytest.raises(ValueError, match="sides must be within"):
        Backend("b", {"train", "nope"})
    with pytest.raises(TypeError, match="unexpected keyword argument.*: colour"):
        Backend("b", {"gen"}, colour="blue")
    assert Backend("b", {"gen"}) == Backend("b", {"gen"}) and not Backend("b", {"gen"}).legacy_demo


def test_demo_fields_given_to_backend_as_before_still_reach_refit_demo_with_a_warning():
    from refit_core.kit.demo import installed_demos

    def program(ctx):
        return None

    with pytest.warns(DeprecationWarning, match="backend 'old': Backend.*demo_gen.*deprecated.*refit_register_demos"):
        old = Backend("old", {"gen"}, demo_gen=program, demo_gen_layout="tp=2", priority=3, demo_quantize={"fp8"})
    pm = PluginManager(load_entry_points=False)

    class OldPlugin:
        @hookimpl
        def refit_register_backends(self, register):
            register(old)

    pm.register(OldPlugin(), name="old")
    demos = installed_demos(pm).of("old")
    assert (demos.gen, demos.gen_layout, demos.priority, demos.quantize) == (program, "tp=2", 3, frozenset({"fp8"}))


def test_demo_programs_come_through_the_kits_own_hook():
    from refit_core.kit.demo import installed_demos

    pm = PluginManager()
    demos = installed_demos(pm)
    toy = demos.of("toy")
    assert (toy.train_layout, toy.gen_layout, toy.priority) == ("dp=2", "dp=3", -100)
    assert toy.program(Side.TRAIN) is not None and toy.program(Side.GEN) is not None
    assert demos.of("no such backend") == DemoPrograms("no such backend")
    assert installed_demos(pm).of("toy") == toy  # the hook is declared once however often it is asked


class BrokenRegistration:
    """A plugin whose registration hook fails."""

    @hookimpl
    def refit_register_backends(self, register):
        raise RuntimeError("cannot register")


def test_a_failing_registration_names_the_plugin():
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(RuntimeError, match="cannot register") as raised:
        pm.register(BrokenRegistration(), name="broken")
    assert "refit_register_backends of refit plugin 'broken'" in "".join(raised.value.__notes__)
