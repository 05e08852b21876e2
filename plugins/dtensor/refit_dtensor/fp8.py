"""DTensor models as FP8 destinations: linear layers holding block-FP8 weights and their scales.

transformers' own block-FP8 layer (``FP8Linear`` from ``transformers.integrations.finegrained_fp8``,
what ``FineGrainedFP8Config`` loads DeepSeek-V3 / Qwen3-FP8 checkpoints into) keeps a float8 ``weight``
and an fp32 ``weight_scale_inv`` of one scale per ``block_size`` block. Such a parameter is a
quantized destination tensor (:class:`refit_core.contract.spec.Quantization`), its scales a tensor of their
own; refit quantizes into them (on the sender where it can) or moves them as bytes from an FP8
trainer. Sharding follows the weights only: shard both alike (or not at all), else setup refuses
the plan naming the tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from refit_core import Quantization

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The float8 dtypes transformers' FP8 layers hold weights in."""
SCALE_SUFFIX = "_scale_inv"
"""What transformers' ``FP8Linear`` (and the checkpoints it loads) append to a weight's name for its scales."""


def quantization_of(model: nn.Module, param_name: str, param: torch.Tensor) -> Quantization | None:
    """The block-FP8 quantization of parameter ``param_name`` (a clean name), or None if it is plain."""
    if param.dtype not in FP8_DTYPES:
        return None
    owner, _, attr = param_name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    block = getattr(module, "block_size", None)
    if block is None or not hasattr(module, attr + SCALE_SUFFIX):
        return None
    return Quantization.block_fp8(param_name + SCALE_SUFFIX, tuple(block), dtype=param.dtype)


def to_block_fp8(model: nn.Module, block: tuple[int, int] = (128, 128), *, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but ``keep``) by transformers' ``FP8Linear`` with
    ``block`` blocks, on the same device; values are not initialized. Returns how many were replaced."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.rsplit(".", 1)[-1] in keep:
            continue
        fp8 = FP8Linear(module.in_features, module.out_features, block_size=tuple(block),
                        has_bias=module.bias is not None).to(module.weight.device)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, fp8)
        replaced += 1
    return replaced
