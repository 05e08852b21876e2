"""The metadata layouts' pipeline split (:mod:`refit_megatron.stages`) against megatron-core's own
``get_transformer_layer_offset`` / ``get_num_layers_to_build``, even and uneven, with virtual stages.

The live path reads the layers megatron-core built (their ``layer_number``); the live refit of an
uneven split is in ``test_megatron_refit.py`` (``pp2-uneven``) and ``test_megatron_mtp.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.environments import require

from refit_core import ParallelLayout, PluginError, RefitError
from refit_core.kit.models import PRESETS

require("refit_megatron")
require("megatron.core")

from refit_megatron.layout import layout_pieces
from refit_megatron.stages import stage_layers

# (layers, pp, vpp, first, last): first / last 0 = not set
SPLITS = [
    (8, 2, 1, 0, 0), (8, 4, 2, 0, 0), (3, 2, 1, 1, 2), (4, 2, 1, 1, 0), (4, 2, 1, 0, 3),
    (61, 16, 1, 3, 2), (61, 16, 1, 1, 0), (61, 16, 1, 0, 1), (10, 4, 2, 2, 4), (12, 4, 2, 2, 2),
    (14, 4, 2, 0, 2), (13, 4, 1, 4, 0), (61, 8, 1, 5, 0),
]


def _megatron(layers: int, pp: int, vpp: int, first: int, last: int, pp_rank: int, vp: int) -> range:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = SimpleNamespace(
        num_layers=layers, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first or None, num_layers_in_last_pipeline_stage=last or None,
        pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False)
    vp_stage = vp if vpp > 1 else None
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


@pytest.mark.parametrize("layers,pp,vpp,first,last", SPLITS)
def test_stage_layers_are_megatrons(layers, pp, vpp, first, last):
    layout = ParallelLayout(pp=pp, vpp=vpp, pp_first=first, pp_last=last)
    ours = [[stage_layers(layers, layout, p, v) for v in range(vpp)] for p in range(pp)]
    assert ours == [[_megatron(layers, pp, vpp, first, last, p, v) for v in range(vpp)] for p in range(pp)]
    assert sorted(n for chunks in ours for r in chunks for n in r) == list(range(layers))


def test_deepseek_v3_pp16_split_as_nemo_rl():
    """61 layers: 3 on the first stage, 2 on the last, 4 on each of the 14 between."""
    layout = ParallelLayout.parse("pp=16,pp_first=3,pp_last=2")
    counts = [len(stage_layers(61, layout, p)) for p in range(16)]
    assert counts == [3] + [4] * 14 + [2]


@pytest.mark.parametrize("layout,message", [
    ("pp=2,pp_first=1,pp_last=1", "2 layers are left for 0 middle"),
    ("pp=3,pp_first=1", "do not split evenly over the 2 middle"),
    ("pp=2,vpp=2,pp_first=1,pp_last=3", "pp_first=1 layers do not split over vpp 2"),
    ("pp=2,pp_first=3,pp_last=3", "exceed the model's 4 layers"),
    ("pp=3", "give the first / last stage its own layer count"),
])
def test_bad_uneven_splits_name_the_problem(layout, message):
    with pytest.raises(PluginError, match=message):
        layout_pieces(dict(PRESETS["tiny-qwen3-moe"], num_hidden_layers=4), ParallelLayout.parse(layout), 0)


def test_uneven_split_needs_pipeline_stages():
    with pytest.raises(RefitError, match="need pp >= 2"):
        ParallelLayout.parse("pp_first=2")
    assert str(ParallelLayout.parse("pp=16,pp_first=3,pp_last=2")) == "pp=16,pp_first=3,pp_last=2"


@pytest.mark.parametrize("backend,message", [("vllm", "vllm layouts take"), ("dtensor", "dtensor layouts take")])
def test_other_backends_refuse_uneven_stages(backend, message):
    from refit_core.contract.plugins import get_plugin_manager

    pm = get_plugin_manager()
    layout = ParallelLayout.parse("pp=2,pp_first=1")
    with pytest.raises(PluginError, match=message):
        if backend == "vllm":
            pm.destination_layout(backend, dict(PRESETS["tiny-qwen3"], num_hidden_layers=4), layout, 0)
        else:
            pm.source_layout(backend, dict(PRESETS["tiny-qwen3"], num_hidden_layers=4), layout, 0)
