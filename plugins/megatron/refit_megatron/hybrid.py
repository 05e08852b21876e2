"""The layer pattern of a hybrid Mamba model (NemotronH): which mixer each layer holds.

megatron-core's ``MambaStack`` builds one layer per character of ``hybrid_override_pattern``
(``M`` Mamba mixer, ``*`` attention, ``-`` MLP, ``E`` MoE); HF NemotronH configs carry the same
string, or (newer transformers) the list ``layers_block_type`` spelled out, which this module
reads back into the string.
"""

from __future__ import annotations

from typing import Any

from refit_core import PluginError

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
"""megatron-core's ``mamba_hybrid_layer_allocation.Symbols``."""

_BLOCK_TYPES = {
    "mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
    "mlp": MLP, "moe": MOE,
}


def hybrid_pattern(config: dict[str, Any]) -> str:
    """The layer pattern (``"M-M*ME"``) of a HF NemotronH config, or a PluginError naming what is wrong."""
    pattern = config.get("hybrid_override_pattern")
    if pattern is None:
        types = config.get("layers_block_type") or config.get("layer_types")
        if not types:
            raise PluginError("a hybrid Mamba config needs hybrid_override_pattern or layers_block_type")
        unknown = sorted({t for t in types if t not in _BLOCK_TYPES})
        if unknown:
            raise PluginError(f"layers_block_type has unknown layer types {unknown} (known: {sorted(_BLOCK_TYPES)})")
        pattern = "".join(_BLOCK_TYPES[t] for t in types)
    bad = sorted(set(pattern) - {MAMBA, ATTENTION, MLP, MOE})
    if bad:
        raise PluginError(f"hybrid pattern {pattern!r} has unknown layer symbols {bad} (known: M * - E)")
    layers = config.get("num_hidden_layers")
    if layers is not None and layers != len(pattern):
        raise PluginError(f"hybrid pattern {pattern!r} has {len(pattern)} layers, num_hidden_layers says {layers}")
    return str(pattern)


_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias"}
"""Older NemotronH configs spell some Mamba settings with a ``mamba_`` prefix (transformers reads both)."""


def mamba_setting(config: dict[str, Any], key: str, default: Any = None) -> Any:
    """A Mamba setting of a NemotronH config under its name or its older alias; ``default`` when neither is
    given (None: a PluginError naming the setting)."""
    for name in (key, _ALIASES.get(key)):
        if name is not None and config.get(name) is not None:
            return config[name]
    if default is None:
        raise PluginError(f"the NemotronH config has no {key!r}")
    return default
