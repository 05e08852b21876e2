"""What the mapping needs to know of a model, read once from its HF config."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from refit_core import PluginError

from .families import Family, Rule, family_of
from .hybrid import mamba_setting
from .rules import Attention, Mamba


@dataclass(frozen=True)
class ModelFacts:
    """A HF config's family, attention (and Mamba mixer) shape, vocabulary and expert count."""

    family: Family
    attention: Attention | None
    vocab: int
    experts: int
    layers: int
    mtp_layers: int
    tied: bool
    mamba: Mamba | None = None

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelFacts:
        family = family_of(config)
        attention = None
        if not family.mla:
            heads = config["num_attention_heads"]
            attention = Attention(heads, config.get("num_key_value_heads") or heads,
                                  config.get("head_dim") or config["hidden_size"] // heads)
        mtp = int(config.get("num_nextn_predict_layers") or 0)
        mamba = None
        if family.hybrid:
            if mtp:
                raise PluginError("NemotronH MTP layers are not mapped by refit-plugin-megatron")
            heads = config["mamba_num_heads"]
            mamba = Mamba(heads * config["mamba_head_dim"], mamba_setting(config, "n_groups"),
                          config["ssm_state_size"], heads)
        return cls(family, attention, config["vocab_size"], family.num_experts(config), family.num_layers(config),
                   mtp, bool(config.get("tie_word_embeddings")), mamba)

    def layer_prefix(self, layer: int) -> str:
        """The HF name prefix of global layer ``layer`` (``model.layers.3.``, NemotronH's ``backbone.layers.3.``)."""
        return f"{self.family.layer_prefix}{layer}."


@functools.cache
def _pattern(megatron_name: str) -> re.Pattern[str]:
    return re.compile(re.escape(megatron_name).replace(r"\{i\}", r"(\d+)") + "$")


def match(rules: dict[str, Rule], name: str) -> tuple[Rule, int | None] | None:
    """The rule of a relative megatron name, and the local expert index in it (``{i}``), or None."""
    rule = rules.get(name)
    if rule is not None:
        return rule, None
    for key, rule in rules.items():
        if "{i}" in key:
            found = _pattern(key).match(name)
            if found:
                return rule, int(found.group(1))
    return None
