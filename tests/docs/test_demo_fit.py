"""``refit demo`` on the GPUs present: the layout choice, given a GPU count (no GPU needed)."""

import pytest

from tests.environments import BY_DESIGN

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.errors import RefitError
from refit_core.contract.plugins import get_plugin_manager
from refit_core.tools.demo.fit import SideLayout, fit_layouts
from refit_core.tools.demo.runner import DemoPlan, fit_to_gpus


def sides(train="fsdp=2", gen="tp=2", *, train_given=False, gen_given=False, trainer="dtensor", engine="dtensor"):
    return SideLayout(TRAIN, trainer, train, train_given), SideLayout(GEN, engine, gen, gen_given)


@pytest.mark.parametrize("trainer, train_default, engine, gen_default", [
    ("dtensor", "fsdp=2", "dtensor", "tp=2"),
    ("megatron", "tp=2", "vllm", ""),
])
def test_colocated_defaults_shrink_to_one_gpu(trainer, train_default, engine, gen_default):
    """Issue 27: ``refit demo --colocate`` on one GPU put two ranks of one NCCL group on it."""
    fit = fit_layouts(*sides(train_default, gen_default, trainer=trainer, engine=engine), 1, colocate=True)
    assert (fit.train_layout, fit.gen_layout) == ("", "")
    assert any(f"{trainer} train side's default layout {train_default}" in n and "1 GPU present" in n
               for n in fit.notes)


def test_colocated_defaults_run_as_they_are_when_every_rank_has_a_gpu():
    fit = fit_layouts(*sides(), 2, colocate=True)
    assert (fit.train_layout, fit.gen_layout, fit.notes) == ("fsdp=2", "tp=2", ())


def test_side_by_side_defaults_keep_the_sides_on_different_gpus():
    fit = fit_layouts(*sides(), 2, colocate=False)
    assert (fit.train_layout, fit.gen_layout) == ("", "")
    assert "need 4 GPUs side by side" in fit.notes[-1] and "2 GPUs present" in fit.notes[-1]
    fit = fit_layouts(*sides(), 4, colocate=False)
    assert (fit.train_layout, fit.gen_layout, fit.notes) == ("fsdp=2", "tp=2", ())


@pytest.mark.parametrize("colocate", [True, False])
def test_a_given_layout_that_cannot_fit_is_refused_naming_it_and_the_gpu_count(colocate):
    with pytest.raises(RefitError) as err:
        fit_layouts(*sides(train="fsdp=2,tp=2", train_given=True), 2, colocate=colocate)
    text = str(err.value)
    assert "--train-layout fsdp=2,tp=2 puts 4 ranks" in text and "on 2 GPUs" in text and "Duplicate GPU" in text


def test_a_given_layout_stays_and_only_the_default_side_shrinks():
    fit = fit_layouts(*sides(train="fsdp=2", train_given=True), 2, colocate=False)
    assert (fit.train_layout, fit.gen_layout) == ("fsdp=2", "tp=2")  # 4 ranks on 2 GPUs: pairs share by IPC
    fit = fit_layouts(*sides(gen="tp=1", gen_given=True), 1, colocate=True)
    assert (fit.train_layout, fit.gen_layout) == ("", "tp=1")


def test_no_gpu_is_refused():
    with pytest.raises(RefitError, match="no CUDA GPU is present"):
        fit_layouts(*sides(), 0, colocate=False)


def test_the_demo_plan_is_fitted_before_anything_starts(capsys):
    pm = get_plugin_manager()
    toy_train, toy_gen = pm.backend("toy", TRAIN), pm.backend("toy", GEN)
    plan = DemoPlan(toy_train, toy_gen, "tiny-llama", "dp=2", "dp=3", 2, "cuda", colocate=True)
    fitted = fit_to_gpus(plan, train_given=False, gen_given=False, gpus=1)
    assert (fitted.train_layout, fitted.gen_layout) == ("", "")
    assert "toy gen side's default layout dp=3 (3 ranks) needs 3 GPUs" in capsys.readouterr().out
    with pytest.raises(RefitError, match="--gen-layout dp=3 puts 3 ranks .* on 1 GPU,"):
        fit_to_gpus(plan, train_given=False, gen_given=True, gpus=1)
    cpu = DemoPlan(toy_train, toy_gen, "tiny-llama", "dp=2", "dp=3", 2, "cpu")
    assert fit_to_gpus(cpu, train_given=False, gen_given=False, gpus=0) == cpu


def test_the_command_refuses_before_starting_anything():
    """No GPU here: ``refit demo --device cuda`` stops at the layout check, before any program starts."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip(f"{BY_DESIGN}this machine has GPUs (the check is of a machine without one)")
    out = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--device", "cuda", "--train", "toy",
                          "--gen", "toy", "--colocate"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA GPU is present" in out.stderr
    assert "logs" not in out.stdout and "build" not in out.stdout
