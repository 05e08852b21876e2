"""Metadata-only megatron layouts (``refit plan --train megatron:...``) and bad input, in-process.

The live pieces of the same layouts are compared with these in ``test_megatron_refit.py``; here the
planner checks that every layout covers every byte of the destination exactly once.
"""

from __future__ import annotations

import pytest

from tests.environments import require

from refit_core import ParallelLayout, PluginError
from refit_core.kit.models import PRESETS
from refit_core.tools.cli import main

require("refit_megatron")

from refit_megatron.layout import coordinates, layout_pieces

PLANS = [
    ("tiny-llama", "megatron:tp=2,pp=2", "vllm:tp=2"),
    ("tiny-qwen3", "megatron:tp=4", "dtensor:fsdp=2"),
    ("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=2,dp=2", "vllm:tp=2"),
    ("tiny-qwen3-moe", "megatron:tp=2,ep=2,etp=2,dp=2", "vllm:tp=1"),
    ("tiny-mixtral", "megatron:pp=2,vpp=1,ep=4,dp=4", "vllm:tp=2"),
    ("tiny-qwen3-tied", "megatron:tp=2,pp=2", "vllm:tp=1"),
]


@pytest.mark.parametrize("model,train,gen", PLANS)
def test_refit_plan_covers_every_byte(model, train, gen, capsys):
    assert main(["plan", "--model", model, "--train", train, "--gen", gen]) == 0
    out = capsys.readouterr().out
    assert "fingerprint:" in out and "train ->" in out


def test_rank_coordinates_follow_megatrons_order():
    layout = ParallelLayout(tp=2, pp=2, dp=2, ep=2)
    seen = [coordinates(layout, r) for r in range(layout.world_size)]
    assert [(c.tp, c.dp, c.pp) for c in seen[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [c.pp for c in seen] == [0] * 4 + [1] * 4
    assert [c.ep for c in seen[:4]] == [0, 1, 0, 1]


def test_tied_embeddings_are_sent_by_the_first_stage_only():
    config = PRESETS["tiny-qwen3-tied"]
    layout = ParallelLayout(pp=2)
    first, last = (layout_pieces(config, layout, r) for r in (0, 1))
    assert any(p.spec.name == "model.embed_tokens.weight" for p in first)
    assert not any(p.spec.name in ("model.embed_tokens.weight", "lm_head.weight") for p in last)


def test_padded_vocabulary_sends_only_real_rows():
    config = dict(PRESETS["tiny-llama"], vocab_size=500)  # Megatron pads to 512 at TP 2
    rows = [p.box for r in (0, 1) for p in layout_pieces(config, ParallelLayout(tp=2), r)
            if p.spec.name == "model.embed_tokens.weight"]
    assert [(b.offsets[0], b.sizes[0]) for b in rows] == [(0, 256), (256, 244)]


@pytest.mark.parametrize("layout,message", [
    ("fsdp=2", "no fsdp degree"),
    ("pp=3", "do not split evenly"),
    ("tp=2,ep=4", "must divide"),
])
def test_bad_layouts_fail_naming_the_problem(layout, message):
    with pytest.raises(PluginError, match=message):
        layout_pieces(PRESETS["tiny-qwen3-moe"], ParallelLayout.parse(layout), 0)


def test_unknown_architecture_names_the_known_ones():
    with pytest.raises(PluginError, match="no mapping for architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        layout_pieces({**PRESETS["tiny-llama"], "architectures": ["GPT2LMHeadModel"]}, ParallelLayout(), 0)
