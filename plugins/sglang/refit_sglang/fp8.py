"""Block-FP8 SGLang models: which HF tensors they hold quantized, and their scale tensors.

An SGLang model built with a block-FP8 quantization config (``Fp8Config(weight_block_size=[128,
128])``, what SGLang makes of a checkpoint with ``quant_method: fp8``) keeps its linear and MoE
weights as float8 ``weight`` / ``w13_weight`` / ``w2_weight`` beside fp32 ``weight_scale_inv``
scales, one per 128 x 128 block. Which HF tensors land in such a parameter is learned from the model's
own ``load_weights`` (traced once on meta tensors, like every other layout): each becomes a quantized
spec (:class:`refit_core.contract.spec.Quantization`, block FP8) with its ``<name>_scale_inv`` scale tensor.
refit then quantizes BF16 trainer weights into them (on the sender where transfers hold whole blocks)
and, since their quantization methods are not plain copies, hands the FP8 values and scales to SGLang's
own ``load_weights`` (the loader path), whose result is bit for bit that of loading a checkpoint the
reference quantizer made.
"""

from __future__ import annotations

import torch

from refit_core import Quantization, TensorSpec
from refit_core.kit import trace_loads

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The float8 dtypes SGLang holds block-FP8 weights in."""
SCALE_SUFFIX = "_scale_inv"
"""What SGLang's (DeepSeek-style) block-FP8 checkpoints append to a weight's name to name its block scales."""


def holds_fp8(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is float8 (a quantized SGLang model)."""
    return any(p.dtype in FP8_DTYPES for p in model.parameters())


def _block(model: torch.nn.Module, module: str) -> tuple[int, ...] | None:
    method = getattr(model.get_submodule(module), "quant_method", None)
    block = getattr(getattr(method, "quant_config", None), "weight_block_size", None)
    return tuple(int(b) for b in block) if block else None


def block_fp8_specs(model: torch.nn.Module, specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` (plain HF tensors) as ``model`` holds them: every tensor whose bytes land in a
    float8 parameter of a block-quantized module becomes a block-FP8 spec, followed by the spec of
    its scale tensor; the rest is unchanged."""
    trace = trace_loads(model, specs)
    out: list[TensorSpec] = []
    for spec in specs:
        fp8 = [key for key in sorted(trace.touched.get(spec.name, ())) if trace.targets[key].dtype in FP8_DTYPES]
        block = _block(model, fp8[0][0]) if fp8 else None
        if block is None or len(spec.shape) != len(block):
            out.append(spec)
            continue
        dtype = trace.targets[fp8[0]].dtype
        quant = Quantization.block_fp8(spec.name + SCALE_SUFFIX, block, dtype=dtype)
        out += [TensorSpec(spec.name, spec.shape, dtype, quant), quant.scale_spec(spec.shape)]
    return out
