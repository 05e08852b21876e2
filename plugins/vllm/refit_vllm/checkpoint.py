"""The HF checkpoint a running vLLM engine was built from: tensor names and full shapes.

refit speaks HF checkpoint names; a live vLLM model only knows its fused parameters. The names come
from the engine's own checkpoint when it is a local directory (safetensors headers: names, shapes and
dtypes, read without loading a byte), else from its config (``refit_core.models.checkpoint_specs``:
transformers on the meta device, or refit's table without transformers).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from refit_core import RefitError, TensorSpec
from refit_core.inventory import safetensors_specs

log = logging.getLogger("refit.vllm")


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
                             f"safetensors directory, and {exc}") from exc
        log.info("refit: %s has no local safetensors; using the %s inventory from its config",
                 model_config.model, config.get("architectures"))
    return [TensorSpec(s.name, s.shape, dtype if s.dtype.is_floating_point else s.dtype) for s in specs]
