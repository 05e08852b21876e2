"""LoRA from metadata alone: ``LoraSpec.parse``, adapter pieces derived from a model's linear shapes, and
``refit plan --lora`` printing adapter bytes beside the full model's, and an engine's own adapter map
(``refit_adapter_destination_layout``) used in place of the derived one."""

import pytest

from refit_core import (DestinationMap, DestinationPiece, LoraMode, LoraSpec, OptionError, ParallelLayout, PlanError,
                        get_plugin_manager, hookimpl)
from refit_core.contract.plugins import PluginManager
from refit_core.kit.models import PRESETS
from refit_core.plan.lora import adapter_metas
from refit_core.plan.offline import plan_from_metadata
from refit_core.tools.cli import main

TINY = PRESETS["tiny-llama"]  # hidden 128, kv 64, intermediate 256, 2 layers, fp32


def _bytes(lora: LoraSpec | None, train: str = "fsdp=2", gen: str = "tp=2") -> int:
    summary = plan_from_metadata(get_plugin_manager(), dict(TINY), "dtensor", ParallelLayout.parse(train),
                                 "dtensor", ParallelLayout.parse(gen), lora=lora)
    return summary.schedule.summary.bytes


def test_adapter_bytes_are_rank_times_in_plus_out_of_every_target():
    lora = LoraSpec.parse("r=8,targets=q,k,v,o,gate,up,down")
    per_layer = 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 256) * 3)
    assert _bytes(lora, gen="tp=1") == 2 * per_layer * 4
    # tp=2: column-parallel B split, A whole on both ranks; row-parallel A split, B whole on both
    column = 8 * (128 // 2 + 128) + 8 * (64 // 2 + 128) * 2 + 8 * (256 // 2 + 128) * 2  # q, k, v, gate, up
    row = 8 * (128 // 2 + 128) + 8 * (256 // 2 + 128)  # o, down
    assert _bytes(lora) == 2 * 2 * (column + row) * 4


def test_merged_mode_moves_the_whole_model_and_adapter_mode_a_fraction():
    full = _bytes(None)
    assert _bytes(LoraSpec.parse("r=8,mode=merged")) == full
    assert 0 < _bytes(LoraSpec.parse("r=8,targets=q,v")) < full / 10


def test_bad_lora_input_is_named():
    with pytest.raises(PlanError, match=r"\['w1'\] name no 2-D weight"):
        _bytes(LoraSpec.parse("r=8,targets=q,w1"))
    with pytest.raises(OptionError, match="integer r"):
        LoraSpec.parse("targets=q")
    assert LoraSpec.parse("r=4,alpha=8,targets=q,k,mode=merged").mode is LoraMode.MERGED


def test_plan_lora_prints_bytes_beside_the_full_models(capsys):
    code = main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "dtensor:tp=1",
                 "--lora", "r=8,targets=q,k,v,o,gate,up,down", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "lora:         adapter mode, r=8" in out.out
    assert "128.0 KiB per step vs" in out.out, out.out


class WholeSlots:
    """A gen plugin whose LoRA slots hold every adapter tensor whole on every rank (no TP slicing)."""

    @hookimpl
    def refit_adapter_destination_layout(self, backend: str, config: dict, layout: ParallelLayout, rank: int,
                                         lora: LoraSpec) -> DestinationMap | None:
        if backend != "dtensor":
            return None
        metas = adapter_metas([[p.meta for p in get_plugin_manager().destination_layout(
            backend, config, ParallelLayout(), 0).pieces]], lora)[0]
        return DestinationMap(pieces=[DestinationPiece(m.spec, m.spec.full_box()) for m in metas])


def test_an_engines_own_adapter_map_replaces_the_derived_one():
    pm = PluginManager()
    lora = LoraSpec.parse("r=8,targets=q,o")
    derived = plan_from_metadata(pm, dict(TINY), "dtensor", ParallelLayout(fsdp=2), "dtensor", ParallelLayout(tp=2),
                                 lora=lora).schedule.summary.bytes
    pm.register(WholeSlots(), name="whole-slots")
    whole = plan_from_metadata(pm, dict(TINY), "dtensor", ParallelLayout(fsdp=2), "dtensor", ParallelLayout(tp=2),
                               lora=lora).schedule.summary.bytes
    assert derived == 2 * 2 * 8 * ((128 // 2 + 128) * 2) * 4  # q: B split, A whole; o: A split, B whole
    assert whole == 2 * 2 * 8 * ((128 + 128) * 2) * 4  # both whole on both ranks
    merged = plan_from_metadata(pm, dict(TINY), "dtensor", ParallelLayout(fsdp=2), "dtensor", ParallelLayout(tp=2),
                                lora=LoraSpec.parse("r=8,targets=q,o,mode=merged")).schedule.summary.bytes
    assert merged == _bytes(None)  # merged mode asks no adapter map
