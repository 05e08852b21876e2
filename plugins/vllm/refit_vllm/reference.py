"""Ground truth for checks: tiny HF model directories and greedy generation with HF transformers.

Nothing here touches a hub: a model directory is written from a config dict (``refit_core.kit.models``
presets) and a state dict in checkpoint format (per-expert names), which both vLLM and transformers
load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from refit_core import TensorSpec

DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5), (17, 99, 3), (400, 5, 271, 8, 31, 2))


def hf_config(config: Mapping[str, Any]) -> Any:
    """A transformers config object from a ``config.json``-style dict (which must name its ``model_type``)."""
    import transformers

    values = dict(config)
    architectures = values.pop("architectures", None)
    hf = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    if architectures:
        hf.architectures = list(architectures)
    return hf


def write_model_dir(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                    path: str | os.PathLike) -> Path:
    """``config.json`` + ``model.safetensors`` (checkpoint names, contiguous tensors) in ``path``."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    hf_config(config).save_pretrained(root)
    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(root / "model.safetensors"),
              metadata={"format": "pt"})
    return root


def hf_greedy(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by HF transformers (fp32, CPU), EOS ignored."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return hf_greedy_model(model, prompts, max_new_tokens)


def hf_greedy_model(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by an HF model already built (a PEFT model too), EOS ignored."""
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def reference_dir(config: Mapping[str, Any], seed: int, step: int, path: str | os.PathLike,
                  specs: Sequence[TensorSpec] | None = None) -> Path:
    """A model directory holding ``refit_core.kit.models.reference_state_dict`` at ``step``: of ``specs``
    (a model's inventory) when given, else of the config's inventory."""
    from refit_core.apps import reference_state_dict

    return write_model_dir(config, reference_state_dict(dict(config) if specs is None else specs, seed, step), path)
