"""HuggingFace checkpoint names for the parameters of a ``transformers`` model.

A module's parameter name (``model.layers.0.mlp.experts.gate_up_proj``) is not always a checkpoint
name: wrappers add segments (activation checkpointing's ``_checkpoint_wrapped_module``,
``torch.compile``'s ``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``), tied parameters
(``lm_head`` sharing ``embed_tokens``) are absent from the checkpoint, and transformers 5 fuses
some checkpoint tensors into one parameter when it loads them (MoE experts stacked into 3-D
``gate_up_proj`` / ``down_proj``; Mixtral's ``block_sparse_moe`` renamed ``mlp``).

The last part is read from transformers' own conversion mapping (the one ``save_pretrained``
reverses), so it follows the library rather than a hand-written table. Every checkpoint tensor a
parameter holds becomes a :class:`Target`: a box of the parameter, optionally with dimensions
permuted. Per-expert checkpoint names are emitted *grouped* (``...experts.gate_proj.weight`` of
shape ``[E, I, H]``), the core's logical tensor for ``...experts.{e}.gate_proj.weight``.
Supported reverse operations: ``Chunk``, ``SplitModulelist(dim=0)`` and ``Transpose``; any other
conversion of a parameter raises :class:`~refit_core.PluginError` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from refit_core import Box, PluginError

WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Module-name segments that wrappers insert and checkpoints never contain."""

_WRAPPER_RE = re.compile(r"(^|\.)(?:" + "|".join(WRAPPER_SEGMENTS) + r")(?=\.|$)")
_GROUP_RE = re.compile(r"\.experts\.\*\.")


def clean_name(name: str) -> str:
    """``model.layers.0._checkpoint_wrapped_module._orig_mod.mlp.w`` -> ``model.layers.0.mlp.w``."""
    return _WRAPPER_RE.sub("", name).lstrip(".")


def unwrap(model: Any) -> Any | None:
    """The ``transformers.PreTrainedModel`` inside ``model`` (through torch.compile, checkpoint
    and DDP/FSDP1 wrappers), or None when ``model`` is not a transformers model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    seen = 0
    while isinstance(model, nn.Module) and seen < 8:
        if isinstance(model, PreTrainedModel):
            return model
        inner = None
        for attr in (*WRAPPER_SEGMENTS, "module"):
            candidate = model._modules.get(attr) if hasattr(model, "_modules") else None
            if isinstance(candidate, nn.Module):
                inner = candidate
                break
        if inner is None:
            return None
        model, seen = inner, seen + 1
    return None


@dataclass(frozen=True)
class Target:
    """A checkpoint tensor held by a parameter.

    The checkpoint tensor ``name`` (global ``shape``) is ``param[region].permute(perm)``, where
    ``region`` is a box of the parameter's global shape.
    """

    name: str
    shape: tuple[int, ...]
    region: Box
    perm: tuple[int, ...]

    def place(self, box: Box) -> tuple[Box, Box] | None:
        """A box of the parameter -> ``(its part inside region relative to box, that part in
        checkpoint coordinates)``, or None when they do not meet."""
        common = box.intersect(self.region)
        if common is None:
            return None
        rel = common.relative_to(self.region)
        hf = Box(tuple(rel.offsets[p] for p in self.perm), tuple(rel.sizes[p] for p in self.perm))
        return common.relative_to(box), hf


class _Region:
    """A region of a parameter being narrowed and permuted by the interpreted operations."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.offsets = [0] * len(shape)
        self.sizes = list(shape)
        self.perm = list(range(len(shape)))  # checkpoint dim i = parameter dim perm[i]

    def copy(self) -> _Region:
        other = _Region(())
        other.offsets, other.sizes, other.perm = list(self.offsets), list(self.sizes), list(self.perm)
        return other

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[p] for p in self.perm)

    def chunks(self, dim: int, parts: int) -> list[_Region]:
        """``torch.chunk(view, parts, dim)`` of the current view."""
        pdim = self.perm[dim]
        size = self.sizes[pdim]
        step = -(-size // parts) if parts else size
        out = []
        for start in range(0, size, max(step, 1)):
            part = self.copy()
            part.offsets[pdim] += start
            part.sizes[pdim] = min(step, size - start)
            out.append(part)
        return out

    def transpose(self, a: int, b: int) -> None:
        self.perm[a], self.perm[b] = self.perm[b], self.perm[a]

    def target(self, name: str) -> Target:
        return Target(name, self.shape, Box(tuple(self.offsets), tuple(self.sizes)), tuple(self.perm))


class Naming:
    """Checkpoint names of one model's parameters (from its class and config)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = getattr(model, "config", None)
        self.renamings: list[Any] = []
        self.converters: list[Any] = []
        self.by_pattern: dict[str, Any] = {}
        self._load_conversions(model)

    def _load_conversions(self, model: Any) -> None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
        except ImportError:  # pragma: no cover - older transformers: names are parameter names
            return
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]  # as save_pretrained does for fresh models
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        self.renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
        self.converters = [c for c in reverse if isinstance(c, WeightConverter)]
        self.by_pattern = {p: c for c in self.converters for p in c.source_patterns}

    def targets(self, param_name: str, shape: tuple[int, ...]) -> list[Target]:
        """The checkpoint tensors a parameter holds (usually one: itself under its own name)."""
        name = clean_name(param_name)
        if not self.renamings and not self.converters:
            return [_Region(shape).target(name)]
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(name, self.renamings, self.converters, reverse=True)
        if pattern is None:
            return [_Region(shape).target(renamed)]
        converter = self.by_pattern[pattern]
        outputs = self._interpret(param_name, converter, shape)
        patterns = list(converter.target_patterns)
        anchor = next((t for t in patterns if t in renamed), None)
        if anchor is None:
            raise PluginError(f"{param_name}: cannot place converter targets {patterns} in {renamed!r}")
        prefix, _, suffix = renamed.partition(anchor)
        return [region.target(_GROUP_RE.sub(".experts.", prefix + t + suffix)) for t, region in outputs]

    def _interpret(self, param_name: str, converter: Any, shape: tuple[int, ...]) -> list[tuple[str, _Region]]:
        """Run the reverse operations symbolically on the parameter's index space."""
        from transformers.core_model_loading import Chunk, SplitModulelist, Transpose

        current: list[tuple[str, _Region]] = [(converter.source_patterns[0], _Region(shape))]
        dim_shift = 0  # after SplitModulelist(0) later dims count from the per-expert tensor
        for op in converter.operations:
            if isinstance(op, Chunk):
                if len(current) != 1:
                    break
                targets = op.get_target_patterns(list(converter.target_patterns), config=self.config)
                parts = current[0][1].chunks(op.dim + dim_shift, len(targets))
                if len(parts) != len(targets):
                    raise PluginError(f"{param_name}: cannot chunk {current[0][1].shape} into {len(targets)}")
                current = list(zip(targets, parts))
            elif isinstance(op, SplitModulelist) and op.dim == 0 and dim_shift == 0:
                if len(current) == 1 and len(converter.target_patterns) == 1:
                    current = [(converter.target_patterns[0], current[0][1])]
                dim_shift = 1
            elif isinstance(op, Transpose):
                for _, region in current:
                    if op.check_dims and region.shape == tuple(shape):
                        continue  # transformers saves such tensors as they are
                    region.transpose(op.dim0 + dim_shift, op.dim1 + dim_shift)
            else:
                break
        else:
            targets = list(converter.target_patterns)
            if len(targets) == 1:  # one-to-one conversions (a Transpose alone) keep the source key
                current = [(targets[0], region) for _, region in current]
            if all(t in targets and ("*" not in t or ".experts.*." in t) for t, _ in current):
                return current
        ops = ", ".join(type(op).__name__ for op in converter.operations)
        raise PluginError(f"{param_name}: transformers converts it to the checkpoint through [{ops}], "
                          "which refit-plugin-dtensor cannot express as views of the parameter")


def tied_targets(model: Any) -> dict[str, str]:
    """``{tied parameter: the parameter it shares}`` of a model whose config ties them."""
    text_config = getattr(model.config, "get_text_config", lambda: model.config)()
    if not getattr(text_config, "tie_word_embeddings", getattr(model.config, "tie_word_embeddings", False)):
        return {}
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def named_parameters(model: Any) -> Iterator[tuple[str, nn.Parameter]]:
    """``(clean name, parameter)`` of every parameter of ``model`` (a wrapped or bare HF model)
    that is a checkpoint tensor: tied duplicates (``lm_head`` when tied) are left out."""
    hf = unwrap(model)
    if hf is None:
        raise PluginError(f"{type(model).__qualname__} is not a transformers PreTrainedModel")
    tied = tied_targets(hf)
    seen: set[int] = set()
    for name, param in hf.named_parameters(remove_duplicate=False):
        name = clean_name(name)
        if name in tied or id(param) in seen:
            continue
        seen.add(id(param))
        yield name, param
