"""A model's checkpoint inventory: safetensors headers, transformers on the meta device, the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.environments import require
import torch

from refit_core import RefitError, TensorSpec
from refit_core.apps import same_bytes
from refit_core.kit.inventory import (
    TABLE_ARCHITECTURES,
    InventorySource,
    config_specs,
    group_specs,
    safetensors_specs,
    table_specs,
)
from refit_core.kit.models import (
    PRESETS,
    checkpoint_specs,
    model_inventory,
    reference_state_dict,
)

transformers = require("transformers")
safetensors_torch = require("safetensors.torch")


def as_dict(specs: list[TensorSpec]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {s.name: (s.shape, s.dtype) for s in specs}


TABLE_PRESETS = sorted(n for n, c in PRESETS.items() if c["architectures"][0] in TABLE_ARCHITECTURES
                       and (n.startswith("tiny-") or n in ("llama-3-8b-shape", "qwen3-30b-a3b-shape")))


@pytest.mark.parametrize("preset", TABLE_PRESETS)
def test_transformers_and_the_table_agree_on_every_preset(preset: str) -> None:
    specs, source = config_specs(PRESETS[preset])
    assert source is InventorySource.TRANSFORMERS
    assert as_dict(specs) == as_dict(table_specs(PRESETS[preset]))


def test_fused_and_shared_expert_architectures_come_from_transformers() -> None:
    base = dict(PRESETS["tiny-llama"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    phi3 = as_dict(checkpoint_specs(dict(base, architectures=["Phi3ForCausalLM"], model_type="phi3")))
    assert phi3["model.layers.1.self_attn.qkv_proj.weight"] == ((256, 128), torch.float32)  # q 128 + k 64 + v 64
    assert phi3["model.layers.1.mlp.gate_up_proj.weight"] == ((512, 128), torch.float32)
    moe = dict(base, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", moe_intermediate_size=64,
               shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2)
    per_expert = as_dict(checkpoint_specs(moe, grouped=False))
    assert per_expert["model.layers.0.mlp.experts.3.gate_proj.weight"] == ((64, 128), torch.float32)
    assert per_expert["model.layers.0.mlp.shared_expert_gate.weight"] == ((1, 128), torch.float32)
    grouped = as_dict(checkpoint_specs(moe))
    assert grouped["model.layers.0.mlp.experts.gate_proj.weight"] == ((4, 64, 128), torch.float32)
    assert grouped["model.layers.0.mlp.shared_expert.up_proj.weight"] == ((96, 128), torch.float32)


def test_without_transformers_the_table_is_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    specs, source = config_specs(PRESETS["tiny-qwen3-moe"])
    assert source is InventorySource.TABLE and as_dict(specs) == as_dict(table_specs(PRESETS["tiny-qwen3-moe"]))
    with pytest.raises(RefitError, match="'Phi3ForCausalLM' is not in refit's built-in table"):
        config_specs(dict(PRESETS["tiny-llama"], architectures=["Phi3ForCausalLM"], model_type="phi3"))


def test_an_architecture_nobody_knows_is_a_clear_error() -> None:
    with pytest.raises(RefitError, match="cannot list the checkpoint tensors of 'NoSuchForCausalLM'"):
        config_specs(dict(PRESETS["tiny-llama"], architectures=["NoSuchForCausalLM"], model_type="no_such"))


def test_safetensors_headers_are_the_inventory_of_a_directory(tmp_path: Path) -> None:
    half = torch.float16
    tensors = {"b.layers.10.w": torch.zeros(2, 3, dtype=torch.bfloat16), "b.layers.2.w": torch.zeros(4),
               "a.experts.1.w": torch.zeros(5, dtype=half), "a.experts.0.w": torch.zeros(5, dtype=half)}
    for prefix, file in (("b", "one.safetensors"), ("a", "two.safetensors")):
        safetensors_torch.save_file({k: v for k, v in tensors.items() if k.startswith(prefix)}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "one.safetensors" if k.startswith("b") else "two.safetensors" for k in tensors}}))
    specs = safetensors_specs(tmp_path)
    assert [s.name for s in specs] == ["a.experts.0.w", "a.experts.1.w", "b.layers.2.w", "b.layers.10.w"]
    assert as_dict(specs) == {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    assert as_dict(group_specs(specs))["a.experts.w"] == ((2, 5), torch.float16)
    assert safetensors_specs(tmp_path / "nothing-here") is None


def test_model_inventory_of_a_directory_follows_its_checkpoint(tmp_path: Path) -> None:
    config = dict(PRESETS["tiny-qwen3-moe"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_inventory(str(tmp_path)).source is InventorySource.TRANSFORMERS  # no weights: from the config
    weights = reference_state_dict(config, seed=3, step=0)
    del weights["model.layers.1.mlp.gate.weight"]  # a checkpoint that differs from what the config implies
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    inventory = model_inventory(str(tmp_path))
    assert inventory.source is InventorySource.SAFETENSORS
    assert as_dict(list(inventory.specs)) == {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
    again = reference_state_dict(inventory.specs, seed=3, step=0)
    assert set(again) == set(weights) and all(same_bytes(again[k], weights[k]) for k in weights)


def test_experts_of_one_group_must_agree() -> None:
    specs = [TensorSpec("m.experts.0.w", (2,), torch.float32), TensorSpec("m.experts.1.w", (3,), torch.float32)]
    with pytest.raises(RefitError, match="experts of m.experts.w differ"):
        group_specs(specs)
