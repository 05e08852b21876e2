"""Hybrid Mamba (NemotronH): a real megatron-core ``MambaModel`` (2 gloo ranks) refit into the kit's
reference engine, TP 1 (two DP replicas), TP 2, PP 2 and EP 2, two steps bit for bit against megatron's
own ``sharded_state_dict()`` converted by the test's routine (``nemotronh_build.py``, ``engine_ranks.py``).

The mixers are megatron-core's ``MambaMixer`` built for real with only mamba_ssm's gated RMSNorm class
stood in for (its kernels are CUDA-only): no Mamba forward runs here. The metadata-only layouts and
the inventory are checked in-process.
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("refit_megatron")

from engine_ranks import LAYOUTS as ALL_LAYOUTS
from engine_ranks import assert_two_refits_landed
from nemotronh_build import CONFIG

from refit_core import ParallelLayout, PluginError

ENGINE_MODEL = "nemotronh"
"""The model this module refits into the reference engine (``tests/megatron/conftest.py``: one spawn for
every such module)."""
LAYOUTS = [name for name in ALL_LAYOUTS if name != "pp2-uneven"]
"""The shared uneven split (1 + 3 layers) fits the 4-layer GPT models, not the hybrid stack's layer count."""


@pytest.fixture(scope="module")
def results(engine_results):
    return engine_results(ENGINE_MODEL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_refits_land_bitwise_equal_to_megatrons_own_weights(results, layout):
    train, gen = results
    assert_two_refits_landed(gen, layout)
    if layout == "tp1":
        assert all(r[layout]["sent_bytes_1"] > 0 for r in train), "both DP replicas share the sending"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pieces_are_views_of_parameters_and_metadata_layout_matches(results, layout):
    train, _ = results
    for rank, result in enumerate(train):
        assert result[layout]["views_share_parameter_memory"], f"train rank {rank}"
        assert result[layout]["metadata_layout_equal"], f"train rank {rank}: refit plan layout differs"
        assert result[layout]["plan_equals_refit_plan"], f"train rank {rank}: live fingerprint != refit plan's"
    # TP 2 splits each of in_proj's z, x, B, C, dt sections: 5 pieces per Mamba layer and rank, else 1
    per_layer = 5 if layout == "tp2" else 1
    mamba_layers = CONFIG["hybrid_override_pattern"].count("M")
    held = sum(r[layout]["in_proj_pieces"] for r in train)
    expected = {"tp1": 2 * mamba_layers, "tp2": 2 * per_layer * mamba_layers, "pp2": mamba_layers,
                "ep2": 2 * mamba_layers}
    assert held == expected[layout]


def test_the_hand_inventory_equals_transformers_own():
    require("transformers.models.nemotron_h")
    from refit_megatron.checkpoint import hf_specs

    from refit_core.kit.inventory import transformers_specs

    theirs = transformers_specs(CONFIG)
    assert theirs is not None
    assert {s.name: (s.shape, s.dtype) for s in hf_specs(CONFIG).values()} == \
           {s.name: (s.shape, s.dtype) for s in theirs}


def test_tp2_in_proj_pieces_place_each_section_per_rank():
    """Rank r of TP 2 holds ``[z_r; x_r; B_r; C_r; dt_r]``: five boxes, one inside each HF section."""
    from refit_megatron.layout import layout_pieces

    inner, bc, heads = 8 * 32, 2 * 16, 8
    starts = (0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc)
    sizes = (inner, inner, bc, bc, heads)
    for rank in (0, 1):
        boxes = [p.box for p in layout_pieces(CONFIG, ParallelLayout(tp=2), rank)
                 if p.spec.name == "backbone.layers.0.mixer.in_proj.weight"]
        assert [(b.offsets[0], b.sizes[0]) for b in boxes] == \
               [(start + rank * size // 2, size // 2) for start, size in zip(starts, sizes)]


def test_older_config_spellings_give_the_same_inventory():
    from refit_megatron.checkpoint import hf_specs

    old = {k: v for k, v in CONFIG.items() if k not in ("n_groups", "conv_kernel")}
    old.update(mamba_n_groups=CONFIG["n_groups"], mamba_d_conv=CONFIG["conv_kernel"], mamba_conv_bias=True)
    assert hf_specs(old) == hf_specs(CONFIG)


def test_layer_types_list_reads_like_the_pattern():
    from refit_megatron.hybrid import hybrid_pattern

    types = ["mamba", "mlp", "linear_attention", "attention", "mamba", "moe"]
    assert hybrid_pattern({"layers_block_type": types}) == "M-M*ME"
    with pytest.raises(PluginError, match="unknown layer symbols"):
        hybrid_pattern({"hybrid_override_pattern": "M-X"})


@pytest.mark.parametrize("layout,message", [
    ("pp=2,vpp=2", "no virtual pipeline"),
    ("tp=4", "must divide over TP 4"),  # 2 Mamba groups
])
def test_layouts_megatron_cannot_build_are_refused(layout, message):
    from refit_megatron.layout import layout_pieces

    config = dict(CONFIG, hybrid_override_pattern="M-M*ME-M", num_hidden_layers=8)
    with pytest.raises(PluginError, match=message):
        layout_pieces(config, ParallelLayout.parse(layout), 0)


def test_refit_plan_covers_every_byte(tmp_path, capsys):
    """``refit plan`` from a NemotronH config.json into FSDP2 (no MoE layer: the DTensor destination
    does not list the router's ``e_score_correction_bias`` buffer)."""
    import json

    from refit_core.tools.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(CONFIG, hybrid_override_pattern="M-M*-M*", num_hidden_layers=7)))
    assert main(["plan", "--model", str(path), "--train", "megatron:tp=2,dp=2", "--gen", "dtensor:fsdp=2"]) == 0
    assert "fingerprint:" in capsys.readouterr().out
