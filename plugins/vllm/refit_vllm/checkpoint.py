"""The HF checkpoint a running vLLM engine was built from: tensor names and full shapes.

refit speaks HF checkpoint names; a live vLLM model only knows its fused parameters. The names come
from the engine's own checkpoint when it is a local directory (safetensors headers: names, shapes and
dtypes, read without loading a byte), else from ``refit_core.models.checkpoint_specs`` for the
decoder families refit knows from ``config.json`` alone.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from refit_core import RefitError, TensorSpec

log = logging.getLogger("refit.vllm")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def safetensors_specs(directory: str | os.PathLike) -> list[TensorSpec] | None:
    """Every tensor of the safetensors checkpoint in ``directory`` (None if there is none)."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        return None
    specs = []
    for name in files:
        for tensor, info in _read_header(root / name).items():
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise RefitError(f"{root / name}: tensor {tensor} has unsupported dtype {info['dtype']}")
            specs.append(TensorSpec(tensor, tuple(info["shape"]), dtype))
    return specs


def engine_checkpoint_specs(model_config: Any) -> list[TensorSpec]:
    """The HF tensors (per-expert names) behind ``model_config``, in the engine's weight dtype.

    Floating-point tensors are reported in the engine's dtype (what its parameters hold; the
    sender casts); other dtypes are kept.
    """
    dtype = model_config.dtype
    specs = None
    if os.path.isdir(model_config.model):
        specs = safetensors_specs(model_config.model)
    if specs is None:
        from refit_core.models import checkpoint_specs

        config = model_config.hf_config.to_dict()
        try:
            specs = checkpoint_specs(config, grouped=False)
        except RefitError as exc:
            raise RefitError(f"cannot list the HF tensors of {model_config.model!r}: it is not a local "
                             f"safetensors directory and {exc}") from exc
        log.info("refit: %s has no local safetensors; using the %s inventory from its config",
                 model_config.model, config.get("architectures"))
    return [TensorSpec(s.name, s.shape, dtype if s.dtype.is_floating_point else s.dtype) for s in specs]
