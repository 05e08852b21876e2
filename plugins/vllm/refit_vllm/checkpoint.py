"""The HF checkpoint a running vLLM engine was built from: tensor names and full shapes.

refit speaks HF checkpoint names; a live vLLM model only knows its fused parameters. The names come
from the engine's own checkpoint when it is a local directory (safetensors headers: names, shapes and
dtypes, read without loading a byte), else from its config (``refit_core.kit.models.checkpoint_specs``:
transformers on the meta device, or refit's table without transformers).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from refit_core import Quantization, RefitError, TensorSpec
from refit_core.kit import checkpoint_specs, safetensors_specs

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The float8 dtypes a block-FP8 checkpoint holds weights in."""
SCALE_SUFFIX = "_scale_inv"
"""What block-FP8 (DeepSeek-style) checkpoints append to a weight's name to name its block scales."""

log = logging.getLogger("refit.vllm")


class UnplannableConfigError(RefitError, TypeError):
    """refit cannot plan from the engine's model config (also the ``TypeError`` of a config of the wrong types)."""


def plannable(model_config: Any) -> tuple[str, dict[str, Any], Any]:
    """(checkpoint path or HF id, ``hf_config`` as a dict, weight dtype) of ``model_config``; raises
    :class:`UnplannableConfigError` naming the field refit cannot read (a mocked or partial config)."""
    why = None
    config: Any = None
    if model_config is None:
        why = "the engine has no model config"
    elif not isinstance(getattr(model_config, "model", None), str):
        why = f"model_config.model is {type(getattr(model_config, 'model', None)).__name__}, not a path or HF id"
    elif not isinstance(getattr(model_config, "dtype", None), torch.dtype):
        why = f"model_config.dtype is {type(getattr(model_config, 'dtype', None)).__name__}, not a torch.dtype"
    else:
        to_dict = getattr(getattr(model_config, "hf_config", None), "to_dict", None)
        config = to_dict() if callable(to_dict) else None
        if not isinstance(config, dict):
            why = f"model_config.hf_config.to_dict() gives {type(config).__name__}, not a dict"
    if why is not None:
        raise UnplannableConfigError(
            f"refit cannot plan from this vLLM model config: {why} (refit lists the engine's HF tensors from "
            f"its checkpoint directory or its hf_config, and their dtype from model_config.dtype)")
    return model_config.model, config, model_config.dtype


def block_fp8_specs(specs: list[TensorSpec], quant_config: dict[str, Any] | None) -> list[TensorSpec]:
    """``specs`` of a block-FP8 checkpoint (``quant_method: fp8`` with ``weight_block_size``, the
    DeepSeek-V3 / Qwen3-FP8 format vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` load) with every
    float8 tensor that has a ``<name>_scale_inv`` sibling marked as quantized; other specs unchanged."""
    block = (quant_config or {}).get("weight_block_size")
    if (quant_config or {}).get("quant_method") != "fp8" or not block:
        return specs
    names = {s.name for s in specs}
    out = []
    for spec in specs:
        scale = spec.name + SCALE_SUFFIX
        if spec.dtype in FP8_DTYPES and scale in names and len(spec.shape) == 2:
            quant = Quantization.block_fp8(scale, tuple(block), dtype=spec.dtype)
            spec = TensorSpec(spec.name, spec.shape, spec.dtype, quant)
        out.append(spec)
    return out


def engine_checkpoint_specs(model_config: Any) -> list[TensorSpec]:
    """The HF tensors (per-expert names) behind ``model_config``, in the engine's weight dtype.

    Floating-point tensors are reported in the engine's dtype (what its parameters hold; the
    sender casts); other dtypes are kept, and so are a block-FP8 checkpoint's float8 weights (as
    quantized tensors, see :func:`block_fp8_specs`) and their fp32 scales: refit quantizes into them.
    """
    model, config, dtype = plannable(model_config)
    specs = None
    if os.path.isdir(model):
        specs = safetensors_specs(model)
    if specs is None:
        try:
            specs = checkpoint_specs(config, grouped=False)
        except RefitError as exc:
            raise RefitError(f"cannot list the HF tensors of {model!r}: it is not a local "
                             f"safetensors directory, and {exc}") from exc
        log.info("refit: %s has no local safetensors; using the %s inventory from its config",
                 model, config.get("architectures"))
    quant_config = getattr(model_config.hf_config, "quantization_config", None)
    specs = block_fp8_specs(specs, quant_config if isinstance(quant_config, dict) else None)
    scales = {s.quant.scale_name for s in specs if s.quant is not None}
    return [s if s.quant is not None or s.name in scales or not s.dtype.is_floating_point
            else TensorSpec(s.name, s.shape, dtype) for s in specs]


def step_catalog(model_config: Any) -> dict[str, TensorSpec]:
    """The HF tensors a refit step moves into this engine, by name: its checkpoint's tensors but the
    block-FP8 scales (refit computes them from the weights it quantizes)."""
    specs = engine_checkpoint_specs(model_config)
    scales = {s.quant.scale_name for s in specs if s.quant is not None}
    return {s.name: s for s in specs if s.name not in scales}
