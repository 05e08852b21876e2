"""The tensor inventory of a HF checkpoint: names, full shapes and dtypes, without loading a weight.

Three sources, best first:

1. a model directory's safetensors headers (``safetensors_specs``): exactly what the checkpoint
   holds, for any architecture, read from the JSON header of each file (no tensor is loaded);
2. a config alone, through ``transformers`` (``transformers_specs``): the model is built on the
   meta device and its state dict reverted to checkpoint format the way ``save_pretrained`` does
   (tied duplicates dropped, fused MoE experts split back into per-expert names), so any decoder
   architecture transformers knows is covered;
3. a hand-written table of a few families (``table_specs``): the dependency-free fallback when
   transformers is not installed.

Every source lists *per-expert* names (``...experts.{e}.gate_proj.weight``) in a stable order;
:func:`group_specs` stacks them into the core's grouped logical tensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertName, default_expert_name
from refit_core.contract.spec import TensorSpec, dtype_from_name

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
"""safetensors header dtype codes -> torch dtypes."""

TABLE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                 "Qwen3MoeForCausalLM", "MixtralForCausalLM"})
"""Architectures the hand-written fallback table lists."""


class InventorySource(Enum):
    """Where a tensor inventory came from."""

    SAFETENSORS = "safetensors headers"
    TRANSFORMERS = "transformers on the meta device"
    TABLE = "refit's built-in table"


# -- config helpers ---------------------------------------------------------------------------


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    """The checkpoint dtype a config declares (``dtype`` or ``torch_dtype``; float32 if neither)."""
    return dtype_from_name(config.get("dtype") or config.get("torch_dtype") or "float32")


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for dense models)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


def architecture(config: dict[str, Any]) -> str:
    return (config.get("architectures") or ["?"])[0]


# -- 1. safetensors headers -------------------------------------------------------------------


def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def safetensors_specs(directory: str | os.PathLike) -> list[TensorSpec] | None:
    """Every tensor of the safetensors checkpoint in ``directory``, or None if it holds none."""
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
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise RefitError(f"{root / name}: tensor {tensor} has unsupported dtype {info['dtype']}")
            specs.append(TensorSpec(tensor, tuple(info["shape"]), dtype))
    return sort_specs(specs)


_NUMBER = re.compile(r"(\d+)")


def sort_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """Specs in natural name order (``layers.2`` before ``layers.10``): a stable checkpoint order."""
    def key(spec: TensorSpec) -> list[Any]:
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in _NUMBER.split(spec.name)]
    return sorted(specs, key=key)


# -- 2. transformers on the meta device -------------------------------------------------------


def transformers_config(config: dict[str, Any]) -> Any:
    """A ``transformers`` config object from a ``config.json``-style dict."""
    import transformers

    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise RefitError(f"config of {architecture(config)!r} has no model_type")
    architectures = values.pop("architectures", None)
    cfg = transformers.AutoConfig.for_model(model_type, **values)
    if architectures:
        cfg.architectures = list(architectures)
    return cfg


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def transformers_specs(config: dict[str, Any]) -> list[TensorSpec] | None:
    """The checkpoint tensors transformers would save for ``config`` (None without transformers).

    Raises :class:`RefitError` when transformers cannot build the architecture.
    """
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    return list(_transformers_specs(json.dumps(config, sort_keys=True)))


@functools.lru_cache(maxsize=16)
def _transformers_specs(config_json: str) -> tuple[TensorSpec, ...]:
    from transformers import AutoModelForCausalLM

    config = json.loads(config_json)
    try:
        with _quiet_transformers(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(transformers_config(config), dtype=config_dtype(config))
    except Exception as exc:  # any failure to build means: not known from config
        raise RefitError(f"transformers cannot build {architecture(config)!r} from its config: "
                         f"{type(exc).__name__}: {exc}") from exc
    state = _checkpoint_state(model)
    return tuple(sort_specs([TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state.items()]))


def _checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """A (meta) model's state dict as ``save_pretrained`` writes it: tied copies dropped, and on
    transformers 5 its load-time conversions (fused experts, renames) reverted."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4: parameters are checkpoint tensors
        if getattr(model.config, "tie_word_embeddings", False):
            for name in getattr(model, "_tied_weights_keys", None) or ():
                state.pop(name, None)
        return state
    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))


# -- 3. the hand-written table ----------------------------------------------------------------


def _is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    if not num_experts(config):
        return False
    step = config.get("decoder_sparse_step", 1) or 1
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def table_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """The checkpoint of a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral config, by hand."""
    arch = architecture(config)
    if arch not in TABLE_ARCHITECTURES:
        raise RefitError(f"architecture {arch!r} is not in refit's built-in table "
                         f"({', '.join(sorted(TABLE_ARCHITECTURES))}); install transformers for any other")
    dtype = config_dtype(config)
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = head_dim(config)
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], hidden), dtype)]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype))
        for proj, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
            specs.append(TensorSpec(f"{p}.self_attn.{proj}.weight", (rows, hidden), dtype))
            if arch == "Qwen2ForCausalLM":
                specs.append(TensorSpec(f"{p}.self_attn.{proj}.bias", (rows,), dtype))
        specs.append(TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, heads * hd), dtype))
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            specs.append(TensorSpec(f"{p}.self_attn.q_norm.weight", (hd,), dtype))
            specs.append(TensorSpec(f"{p}.self_attn.k_norm.weight", (hd,), dtype))
        specs.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype))
        if _is_moe_layer(config, layer):
            specs.extend(_moe_specs(config, arch, p, hidden, dtype))
        else:
            inter = config["intermediate_size"]
            specs.append(TensorSpec(f"{p}.mlp.gate_proj.weight", (inter, hidden), dtype))
            specs.append(TensorSpec(f"{p}.mlp.up_proj.weight", (inter, hidden), dtype))
            specs.append(TensorSpec(f"{p}.mlp.down_proj.weight", (hidden, inter), dtype))
    specs.append(TensorSpec("model.norm.weight", (hidden,), dtype))
    if not config.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], hidden), dtype))
    return sort_specs(specs)


def _moe_specs(config: dict[str, Any], arch: str, prefix: str, hidden: int, dtype: torch.dtype) -> list[TensorSpec]:
    experts = num_experts(config)
    if arch == "MixtralForCausalLM":
        inter = config["intermediate_size"]
        block = f"{prefix}.block_sparse_moe"
        projs = (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden)))
    else:
        inter = config["moe_intermediate_size"]
        block = f"{prefix}.mlp"
        projs = (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))
    return [TensorSpec(f"{block}.gate.weight", (experts, hidden), dtype)] + [
        TensorSpec(f"{block}.experts.{e}.{proj}.weight", shape, dtype) for e in range(experts) for proj, shape in projs]


# -- the inventory of a config, and grouping ---------------------------------------------------


def config_specs(config: dict[str, Any]) -> tuple[list[TensorSpec], InventorySource]:
    """The per-expert checkpoint tensors of ``config``: transformers when installed, else the table."""
    try:
        specs = transformers_specs(config)
    except RefitError as exc:
        if architecture(config) in TABLE_ARCHITECTURES:
            return table_specs(config), InventorySource.TABLE
        raise RefitError(f"cannot list the checkpoint tensors of {architecture(config)!r}: {exc}") from exc
    if specs is None:
        return table_specs(config), InventorySource.TABLE
    return specs, InventorySource.TRANSFORMERS


def group_specs(specs: Sequence[TensorSpec],
                namer: Callable[[str], ExpertName | None] = default_expert_name) -> list[TensorSpec]:
    """Per-expert specs stacked into grouped ``[E, ...]`` tensors (each at its first expert's place)."""
    counts: dict[str, int] = {}
    members: dict[str, TensorSpec] = {}
    for spec in specs:
        expert = namer(spec.name)
        if expert is None:
            continue
        counts[expert.group] = max(counts.get(expert.group, 0), expert.index + 1)
        first = members.setdefault(expert.group, spec)
        if (first.shape, first.dtype) != (spec.shape, spec.dtype):
            raise RefitError(f"experts of {expert.group} differ: {first.name} is {first.shape} {first.dtype}, "
                             f"{spec.name} is {spec.shape} {spec.dtype}")
    out: list[TensorSpec] = []
    for spec in specs:
        expert = namer(spec.name)
        if expert is None:
            out.append(spec)
        elif members[expert.group] is spec:
            out.append(TensorSpec(expert.group, (counts[expert.group], *spec.shape), spec.dtype))
    return out
