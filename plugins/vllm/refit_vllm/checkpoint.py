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

from refit_core import RefitError, TensorSpec
from refit_core.contract.spec import BLOCK_SCALE_SUFFIX, FP8_DTYPES, Quantization
from refit_core.kit.inventory import safetensors_specs

log = logging.getLogger("refit.vllm")




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
        scale = spec.name + BLOCK_SCALE_SUFFIX
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
    dtype = model_config.dtype
    specs = None
    if os.path.isdir(model_config.model):
        specs = safetensors_specs(model_config.model)
    if specs is None:
        from refit_core.kit.models import checkpoint_specs

        config = model_config.hf_config.to_dict()
        try:
            specs = checkpoint_specs(config, grouped=False)
        except RefitError as exc:
            raise RefitError(f"cannot list the HF tensors of {model_config.model!r}: it is not a local "
                             f"safetensors directory, and {exc}") from exc
        log.info("refit: %s has no local safetensors; using the %s inventory from its config",
                 model_config.model, config.get("architectures"))
    quant_config = getattr(model_config.hf_config, "quantization_config", None)
    specs = block_fp8_specs(specs, quant_config if isinstance(quant_config, dict) else None)
    scales = {s.quant.scale_name for s in specs if s.quant is not None}
    return [s if s.quant is not None or s.name in scales or not s.dtype.is_floating_point
            else TensorSpec(s.name, s.shape, dtype) for s in specs]
