"""HF checkpoint names and metadata-only layouts (single process, no process group)."""

import pytest
import torch
from dtensor_ranks import hf_checkpoint
from refit_dtensor import build_model, model_pieces
from refit_dtensor.layout import layout_pieces
from refit_dtensor.names import Naming, clean_name, unwrap
from refit_dtensor.parallel import rank_coordinate

from refit_core import DestinationPiece, ParallelLayout, PluginError, SourcePiece, get_plugin_manager
from refit_core.kit.models import PRESETS, checkpoint_specs
from refit_core.apps import same_bytes
from refit_core.plan.offline import plan_from_metadata

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral"]


def test_wrapper_segments_are_stripped():
    name = "model.layers.3._orig_mod._checkpoint_wrapped_module._fsdp_wrapped_module.mlp.up_proj.weight"
    assert clean_name(name) == "model.layers.3.mlp.up_proj.weight"
    assert clean_name("_orig_mod.lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("model", MODELS)
def test_plain_unsharded_model_pieces_equal_transformers_checkpoint(model):
    """A plain module (no DTensor): one full box per checkpoint tensor, values identical to what
    transformers' own save-side conversion produces, names and shapes as the core's inventory."""
    hf = build_model(dict(PRESETS[model]), seed=3)
    pieces = model_pieces(hf, SourcePiece)
    reference = hf_checkpoint(hf)
    assert sorted(p.spec.name for p in pieces) == sorted(reference)
    for piece in pieces:
        assert piece.box == piece.spec.full_box()
        assert same_bytes(piece.view, reference[piece.spec.name]), piece.spec.name
    assert {p.spec.name: p.spec.shape for p in pieces} == {s.name: s.shape for s in checkpoint_specs(PRESETS[model])}


def test_tied_lm_head_is_not_a_checkpoint_tensor():
    names = {p.spec.name for p in model_pieces(build_model(dict(PRESETS["tiny-qwen3-tied"])), SourcePiece)}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_fused_experts_become_grouped_gate_and_up_views_without_copies():
    hf = build_model(dict(PRESETS["tiny-qwen3-moe"]))
    fused = hf.model.layers[1].mlp.experts.gate_up_proj  # [E, 2I, H]: gate rows, then up rows
    pieces = {p.spec.name: p for p in model_pieces(hf, SourcePiece)}
    gate = pieces["model.layers.1.mlp.experts.gate_proj.weight"]
    up = pieces["model.layers.1.mlp.experts.up_proj.weight"]
    inter = PRESETS["tiny-qwen3-moe"]["moe_intermediate_size"]
    assert gate.spec.shape == up.spec.shape == (8, inter, 128)
    assert gate.view.data_ptr() == fused.data_ptr() and up.view.data_ptr() == fused[:, inter:].data_ptr()
    assert same_bytes(up.view, fused[:, inter:]) and same_bytes(gate.view, fused[:, :inter])
    assert pieces["model.layers.1.mlp.experts.down_proj.weight"].spec.shape == (8, 128, inter)


def test_names_through_torch_compile_and_activation_checkpoint_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    hf = build_model(dict(PRESETS["tiny-qwen3-moe"]))
    apply_activation_checkpointing(hf, check_fn=lambda m: type(m).__name__.endswith("DecoderLayer"))
    for i, layer in enumerate(hf.model.layers):
        hf.model.layers[i] = torch.compile(layer)
    wrapped = torch.compile(hf)
    assert "_orig_mod" in next(n for n, _ in hf.named_parameters() if "layers.0" in n)
    assert unwrap(wrapped) is hf
    pieces = get_plugin_manager().source_pieces(wrapped)
    assert {p.spec.name: p.spec.shape for p in pieces} == \
        {s.name: s.shape for s in checkpoint_specs(PRESETS["tiny-qwen3-moe"])}


def test_mixtral_block_sparse_moe_names_come_from_transformers_mapping():
    names = {p.spec.name for p in model_pieces(build_model(dict(PRESETS["tiny-mixtral"])), SourcePiece)}
    assert "model.layers.0.block_sparse_moe.experts.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)


def test_a_conversion_that_is_not_a_view_is_refused_naming_the_parameter():
    from transformers.core_model_loading import Interleave, WeightConverter

    hf = build_model(dict(PRESETS["tiny-qwen3-moe"]))
    naming = Naming(hf)
    odd = WeightConverter(source_patterns="mlp.experts.gate_up_proj", target_patterns="mlp.experts.w13",
                          operations=[Interleave(dim=1)])
    naming.converters, naming.by_pattern = [odd], {p: odd for p in odd.source_patterns}
    with pytest.raises(PluginError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*Interleave"):
        naming.targets("model.layers.0.mlp.experts.gate_up_proj", (8, 128, 128))


def test_a_transposing_conversion_becomes_a_permuted_view_with_permuted_boxes():
    from refit_dtensor.placements import LocalBlock
    from refit_dtensor.shards import param_pieces
    from transformers.core_model_loading import Transpose, WeightConverter

    from refit_core import Box

    hf = build_model(dict(PRESETS["tiny-qwen3-moe"]))
    naming = Naming(hf)
    flip = WeightConverter(source_patterns="mlp.experts.down_proj", target_patterns="mlp.experts.down_proj",
                           operations=[Transpose(1, 2)])  # as a save-side (reversed) converter
    naming.converters, naming.by_pattern = [flip], {p: flip for p in flip.source_patterns}
    param = hf.model.layers[0].mlp.experts.down_proj  # [E, H, I]
    (target,) = naming.targets("model.layers.0.mlp.experts.down_proj", tuple(param.shape))
    assert (target.name, target.shape) == ("model.layers.0.mlp.experts.down_proj", (8, 64, 128))
    # this rank holds experts 2..5 and hidden rows 32..95 of the parameter
    block = LocalBlock(Box((2, 32, 0), (4, 64, 64)), Box((0, 0, 0), (4, 64, 64)))
    local = param.detach()[2:6, 32:96]
    (piece,) = param_pieces(SourcePiece, [target], param.dtype, [block], local)
    assert piece.box == Box((2, 0, 32), (4, 64, 64))
    assert same_bytes(piece.view, param.detach().transpose(1, 2)[2:6, :, 32:96])


def test_other_modules_are_left_to_other_plugins():
    pm = get_plugin_manager()
    for model in (torch.nn.Linear(2, 2), object()):
        assert pm.hook.refit_source_pieces(model=model) is None
        assert pm.hook.refit_destination_map(model=model) is None
    holder = torch.nn.Module()  # e.g. an engine's own class that keeps an HF model as `.model`
    holder.model = build_model(dict(PRESETS["tiny-llama"]))
    assert unwrap(holder) is None
    names = {b.name: b.sides for b in pm.backends()}
    assert names["dtensor"] == {"train", "gen"}


def test_rank_order_is_dp_fsdp_tp_with_tp_fastest():
    layout = ParallelLayout(dp=2, fsdp=2, tp=2)
    assert [rank_coordinate(layout, r) for r in (0, 1, 2, 5, 7)] == \
        [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]


def test_layouts_with_pipeline_or_other_keys_are_refused():
    with pytest.raises(PluginError, match="pp"):
        layout_pieces(SourcePiece, dict(PRESETS["tiny-llama"]), ParallelLayout(pp=2), 0)


@pytest.mark.parametrize("model,train,gen", [
    ("tiny-qwen3-moe", "fsdp=2,tp=2", "tp=2"),
    ("tiny-qwen3-tied", "tp=2,dp=2", "fsdp=4"),
    ("qwen3-30b-a3b-shape", "fsdp=4,tp=2,dp=2", "tp=4"),
])
def test_metadata_plan_covers_every_destination_byte_once(model, train, gen):
    """``refit plan`` for dtensor on both sides: the planner finds exactly one source for every
    destination element (it raises otherwise) and moves each checkpoint byte to every gen replica."""
    config = dict(PRESETS[model])
    train_layout, gen_layout = ParallelLayout.parse(train), ParallelLayout.parse(gen)
    summary = plan_from_metadata(get_plugin_manager(), config, "dtensor", train_layout, "dtensor", gen_layout)
    per_copy = sum(s.nbytes for s in checkpoint_specs(config))
    replicas = {}  # destination elements per name over all gen ranks / elements of the tensor
    for rank in range(gen_layout.world_size):
        for piece in layout_pieces(DestinationPiece, config, gen_layout, rank):
            replicas[piece.spec.name] = replicas.get(piece.spec.name, 0) + piece.box.numel * \
                torch.empty((), dtype=piece.spec.dtype).element_size()
    assert summary.schedule.summary.bytes == sum(replicas.values())
    assert sum(replicas.values()) >= per_copy
