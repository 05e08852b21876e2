"""What the mapping needs to know of a model, read once from its HF config."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from .families import Family, Rule, family_of
from .rules import Attention


@dataclass(frozen=True)
class ModelFacts:
    """A HF config's family, attention shape, vocabulary and expert count."""

    family: Family
    attention: Attention | None
    vocab: int
    experts: int
    layers: int
    mtp_layers: int
    tied: bool

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelFacts:
        family = family_of(config)
        attention = None
        if not family.mla:
            heads = config["num_attention_heads"]
            attention = Attention(heads, config.get("num_key_value_heads") or heads,
                                  config.get("head_dim") or config["hidden_size"] // heads)
        return cls(family, attention, config["vocab_size"], family.num_experts(config),
                   config["num_hidden_layers"], int(config.get("num_nextn_predict_layers") or 0),
                   bool(config.get("tie_word_embeddings")))


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


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
