"""Expert naming both ways: a plugin's own per-expert scheme goes back to the engine and to
verification under the checkpoint's names (the example plugin names experts without ``.experts.``)."""

import pytest
import torch
from refit_toy.demo import reference
from refit_toy.models import EXPERTS, ODD_GROUPED_EXPERTS
from toy_ranks import TRAIN_RANKS, odd_expert_ranks

from refit_core import Box, DestinationPiece, ExpertName, PluginError, TensorSpec, hookimpl
from refit_core.contract.experts import ExpertNaming, default_expert_name, default_member_name
from refit_core.contract.pieces import PieceMeta
from refit_core.apps import same_bytes
from refit_core.contract.plugins import PluginManager
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.verify import mismatches

ODD = [f"model.layers.0.moe.expert{e}_up.weight" for e in range(EXPERTS)]


def test_the_plugin_hooks_map_its_own_naming_both_ways_and_the_default_stays_for_others():
    pm = PluginManager()
    assert pm.expert_name(ODD[2]) == ExpertName(ODD_GROUPED_EXPERTS, 2)
    assert pm.expert_member_name(ODD_GROUPED_EXPERTS, 2) == ODD[2]
    hf_group = "model.layers.1.mlp.experts.down_proj.weight"
    assert pm.expert_member_name(hf_group, 5) == "model.layers.1.mlp.experts.5.down_proj.weight"
    assert pm.expert_member_name("model.norm.weight", 0) is None
    assert default_member_name(ODD_GROUPED_EXPERTS, 0) is None and default_expert_name(ODD[0]) is None


class DisagreeingPlugin:
    @hookimpl
    def refit_expert_name(self, hf_name):
        return ExpertName("w.group", 0) if hf_name == "w.a0" else None

    @hookimpl
    def refit_expert_member_name(self, group, index):
        return "w.b0" if group == "w.group" else None


def test_naming_hooks_that_are_not_inverses_are_a_plugin_error():
    pm = PluginManager(load_entry_points=False)
    pm.register(DisagreeingPlugin(), name="disagreeing")
    with pytest.raises(PluginError, match=r"refit_expert_member_name\('w.group', 0\) returned 'w.b0'"):
        pm.expert_member_name("w.group", 0)


def test_names_seen_in_metadata_need_no_inverse_hook():
    namer = {"a.x3": ExpertName("a.x", 3), "a.x0": ExpertName("a.x", 0)}.get
    naming = ExpertNaming(namer, lambda group, index: None)
    spec = TensorSpec("a.x3", (2,), torch.float32)
    naming.learn([[PieceMeta(spec, spec.full_box())], [PieceMeta(TensorSpec("a.x0", (2,), torch.float32),
                                                                  spec.full_box())]])
    grouped = torch.arange(8.0).reshape(4, 2)
    with pytest.raises(PluginError, match=r"no per-expert name for expert\(s\) \[1, 2\] of a.x"):
        naming.ungrouped([("a.x", grouped)])
    naming.seen.update({("a.x", 1): "a.x1", ("a.x", 2): "a.x2"})
    out = naming.ungrouped([("a.x", grouped), ("other", grouped)])
    assert [name for name, _ in out] == ["a.x0", "a.x1", "a.x2", "a.x3", "other"]
    assert same_bytes(out[3][1], grouped[3])


def test_verify_stacks_a_grouped_piece_from_the_plugins_own_per_expert_names():
    ref = reference(0, 1, odd_experts=True)
    spec = TensorSpec(ODD_GROUPED_EXPERTS, (EXPERTS, *ref[ODD[0]].shape), torch.float32)
    box = Box((1, 0, 0), (2, *ref[ODD[0]].shape))
    good = DestinationPiece(spec, box, torch.stack([ref[ODD[1]], ref[ODD[2]]]))
    bad = DestinationPiece(spec, box, torch.stack([ref[ODD[1]], ref[ODD[1]]]))
    assert mismatches([good], ref) == []
    assert mismatches([bad], ref) == [f"{ODD_GROUPED_EXPERTS}{box}"]


def test_loader_path_hands_the_engine_its_checkpoint_names_for_a_plugins_own_expert_naming():
    """2 train ranks hold experts under ``...moe.expert{e}_up.weight``; 2 gen ranks receive the
    grouped tensor through the loader path: their engine's loader gets the per-expert names back,
    and every byte lands, for two versions."""
    results = spawn(odd_expert_ranks, TRAIN_RANKS + 2, f"127.0.0.1:{free_port()}", 2, timeout_s=180)
    gen = [r for r in results if r["side"] == "gen"]
    assert len(gen) == 2
    for r in gen:
        for step in r["steps"]:
            assert step["loaded"] == ODD
            assert step["experts_equal"] and all(step["experts_equal"].values()), step
            assert step["fast_path_mismatches"] == []
