"""The vLLM plugin without an engine: metadata-only layouts (``refit plan``), hook selection, geometry.

The live-vs-metadata agreement is checked against real engines in ``test_vllm_engine.py``.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.environments import require

require("refit_vllm")

from architectures import ARCHITECTURES
from refit_vllm.layout import destination_layout, pp_layers
from refit_core.kit.loadtrace import view_as_box

from refit_core import Box, ParallelLayout, PluginError, get_plugin_manager
from refit_core.kit.models import PRESETS, checkpoint_specs


def _boxes(config: dict, layout: ParallelLayout) -> dict[int, dict[str, list[Box]]]:
    out: dict[int, dict[str, list[Box]]] = {}
    for rank in range(layout.tp * layout.pp * layout.dp):
        per: dict[str, list[Box]] = defaultdict(list)
        for piece in destination_layout(config, layout, rank).pieces:
            assert piece.view is None and piece.box.within(piece.spec.shape)
            per[piece.spec.name].append(piece.box)
        out[rank] = per
    return out


def _cases(configs: dict[str, dict], names: list[str], layouts: list[str]) -> list:
    """Each layout with each model it applies to (expert parallelism only with experts), id ``layout-name``."""
    return [pytest.param(name, layout, id=f"{layout}-{name}") for layout in layouts for name in names
            if ParallelLayout.parse(layout).ep == 1
            or configs[name].get("num_experts") or configs[name].get("num_local_experts")]


TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral"]
LAYOUTS = ["tp=1", "tp=2", "tp=4", "pp=2", "tp=2,pp=2", "tp=2,dp=2", "tp=2,ep=2"]


@pytest.mark.parametrize("preset,layout", _cases(PRESETS, TINY, LAYOUTS))
def test_every_element_lands_on_every_replica(preset: str, layout: str) -> None:
    """Every checkpoint element reaches every DP replica (MoE experts: the tp * dp group, as in vLLM)."""
    config = dict(PRESETS[preset])
    lay = ParallelLayout.parse(layout)
    boxes = _boxes(config, lay)
    specs = {s.name: s for s in checkpoint_specs(config)}
    replica = lay.tp * lay.pp
    for dp_i in range(lay.dp):
        counts = {name: torch.zeros(spec.shape, dtype=torch.int32) for name, spec in specs.items()}
        for rank, per in boxes.items():
            for name, rank_boxes in per.items():
                if rank // replica == dp_i or ".experts." in name:
                    for box in rank_boxes:
                        box.slice_of(counts[name]).add_(1)
        for name, count in counts.items():
            assert count.min() >= 1, f"{name}: elements nobody receives in replica {dp_i}"


def test_kv_heads_replicate_when_tp_exceeds_them() -> None:
    config = dict(PRESETS["tiny-llama"])  # 4 heads, 2 KV heads, head_dim 32
    lay = ParallelLayout(tp=4)
    rows = [next(p.box for p in destination_layout(config, lay, r).pieces
                 if p.spec.name == "model.layers.0.self_attn.k_proj.weight") for r in range(4)]
    assert [(b.offsets[0], b.sizes[0]) for b in rows] == [(0, 32), (0, 32), (32, 32), (32, 32)]
    q = [next(p.box for p in destination_layout(config, lay, r).pieces
              if p.spec.name == "model.layers.0.self_attn.q_proj.weight") for r in range(4)]
    assert [(b.offsets[0], b.sizes[0]) for b in q] == [(0, 32), (32, 32), (64, 32), (96, 32)]


def test_vocab_padding_and_tied_embeddings() -> None:
    config = dict(PRESETS["tiny-qwen3-tied"], vocab_size=500)  # padded to 512: 256 rows per rank
    lay = ParallelLayout(tp=2)
    emb = [[p.box for p in destination_layout(config, lay, r).pieces if p.spec.name == "model.embed_tokens.weight"]
           for r in range(2)]
    assert emb == [[Box((0, 0), (256, 128))], [Box((256, 0), (244, 128))]]
    assert not any(p.spec.name == "lm_head.weight" for p in destination_layout(config, lay, 0).pieces)


def test_expert_parallel_blocks_and_moe_tensor_parallel() -> None:
    config = dict(PRESETS["tiny-qwen3-moe"])  # 8 experts, moe_intermediate 64
    name = "model.layers.0.mlp.experts.gate_proj.weight"
    down = "model.layers.0.mlp.experts.down_proj.weight"
    ep = ParallelLayout(tp=2, ep=2)
    assert [next(p.box for p in destination_layout(config, ep, r).pieces if p.spec.name == name)
            for r in range(2)] == [Box((0, 0, 0), (4, 64, 128)), Box((4, 0, 0), (4, 64, 128))]
    tp = ParallelLayout(tp=2, dp=2)  # experts are tensor-parallel over tp * dp = 4 ranks
    assert [next(p.box for p in destination_layout(config, tp, r).pieces if p.spec.name == down)
            for r in range(4)] == [Box((0, 0, 16 * r), (8, 128, 16)) for r in range(4)]


def test_pipeline_stages() -> None:
    config = dict(PRESETS["tiny-llama"], num_hidden_layers=5)
    lay = ParallelLayout(pp=2)
    names = [{p.spec.name for p in destination_layout(config, lay, r).pieces} for r in range(2)]
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" not in names[0]
    assert {"lm_head.weight", "model.norm.weight"} <= names[1] and "model.embed_tokens.weight" not in names[1]
    assert pp_layers(5, 0, 2) == (0, 3) and pp_layers(5, 1, 2) == (3, 5)
    assert any(".layers.2." in n for n in names[0]) and not any(".layers.3." in n for n in names[0])


def test_bad_layouts_are_refused() -> None:
    config = dict(PRESETS["tiny-qwen3-moe"])
    with pytest.raises(PluginError, match="ep must be"):
        destination_layout(config, ParallelLayout(tp=2, ep=4), 0)
    with pytest.raises(PluginError, match="fsdp"):
        destination_layout(config, ParallelLayout(fsdp=2), 0)
    with pytest.raises(PluginError, match="cannot"):
        destination_layout(config, ParallelLayout(tp=3), 0)


def test_hooks_select_themselves() -> None:
    pm = get_plugin_manager()
    assert pm.hook.refit_destination_map(model=torch.nn.Linear(2, 2)) is None
    assert pm.hook.refit_begin_update(model=torch.nn.Linear(2, 2)) is None
    assert any(b.name == "vllm" for b in pm.backends("gen"))
    mapping = pm.destination_layout("vllm", dict(PRESETS["tiny-llama"]), ParallelLayout(tp=2), 1)
    assert mapping.pieces and mapping.loader == []


def test_view_as_box_geometry() -> None:
    base = torch.empty(4, 6, 8)
    view = base[2, 1:5, 3:7]
    box, dims = view_as_box((4, 6, 8), base.stride(), view.storage_offset(), tuple(view.shape), view.stride())
    assert box == Box((2, 1, 3), (1, 4, 4)) and dims == (1, 2)
    t = base[:, 0, :].t()  # transposed views are boxes too (dims report the permutation)
    box, dims = view_as_box((4, 6, 8), base.stride(), t.storage_offset(), tuple(t.shape), t.stride())
    assert box == Box((0, 0, 0), (4, 1, 8)) and dims == (2, 0)
    assert view_as_box((4, 6, 8), base.stride(), 0, (3, 3), (9, 1)) is None  # skewed: not a box


@pytest.mark.parametrize("name,layout", _cases(ARCHITECTURES, ["qwen2-moe", "phi3", "olmo2"],
                                               ["tp=2", "tp=2,dp=2", "tp=2,ep=2"]))
def test_architectures_outside_the_table_every_element_lands(name: str, layout: str) -> None:
    """Every tensor of the config's inventory (transformers on meta) is placed, every element received."""
    config = ARCHITECTURES[name]
    lay = ParallelLayout.parse(layout)
    specs = {s.name: s for s in checkpoint_specs(config)}
    boxes = _boxes(config, lay)
    assert {n for per in boxes.values() for n in per} == set(specs)
    counts = {name: torch.zeros(spec.shape, dtype=torch.int32) for name, spec in specs.items()}
    for per in boxes.values():
        for tensor, rank_boxes in per.items():
            for box in rank_boxes:
                box.slice_of(counts[tensor]).add_(1)
    for tensor, count in counts.items():
        assert count.min() >= 1, f"{tensor}: elements nobody receives"


def test_fused_checkpoint_qkv_and_gate_up_split_per_rank() -> None:
    """Phi-3 stores [q; k; v] and [gate; up] fused: each TP rank gets its q, k, v (gate, up) rows."""
    from architectures import ARCHITECTURES

    config = ARCHITECTURES["phi3"]  # 4 heads, 2 KV heads, head_dim 32, intermediate 256
    for rank, (q, kv, gu) in enumerate([((0, 64), (128, 160), (0, 128)), ((64, 128), (160, 192), (128, 256))]):
        pieces = destination_layout(config, ParallelLayout(tp=2), rank).pieces
        qkv = sorted((p.box.offsets[0], p.box.ends[0]) for p in pieces
                     if p.spec.name == "model.layers.0.self_attn.qkv_proj.weight")
        assert qkv == [q, kv, (kv[0] + 64, kv[1] + 64)]
        gate_up = sorted((p.box.offsets[0], p.box.ends[0]) for p in pieces
                         if p.spec.name == "model.layers.0.mlp.gate_up_proj.weight")
        assert gate_up == [gu, (gu[0] + 256, gu[1] + 256)]


@pytest.mark.parametrize("name", ["qwen2-moe", "phi3"])
def test_refit_plan_from_a_config_json_outside_the_table(name: str, tmp_path) -> None:
    """``refit plan --model config.json`` (transformers on meta) plans dtensor TP x FSDP into vLLM TP."""
    import json
    import subprocess
    import sys

    from architectures import ARCHITECTURES

    (tmp_path / "config.json").write_text(json.dumps(ARCHITECTURES[name]))
    proc = subprocess.run([sys.executable, "-m", "refit_core", "plan", "--model", str(tmp_path / "config.json"),
                           "--train", "dtensor:fsdp=2,tp=2", "--gen", "vllm:tp=2"], check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = sum(s.nbytes for s in checkpoint_specs(ARCHITECTURES[name]))
    assert "ranks:        4 train -> 2 gen" in proc.stdout
    planned = next(line for line in proc.stdout.splitlines() if line.strip().startswith("bytes:")).split()
    assert planned[2] == "MiB" and abs(float(planned[1]) - total / 2**20) < 0.1, (total, planned)  # + replicated norms
