"""refit-plugin-megatron: megatron-core ``GPTModel`` trainers as refit sources.

``RefitSender(MegatronSource(model_chunks, hf_config), ...)`` on every train rank; see README.md.
"""

from .build import (
           BuildOptions,
           build_gpt,
           destroy_parallel,
           init_parallel,
           padded_vocab,
)
from .families import FAMILIES, Family, Kind, Rule, family_of
from .source import MegatronSource, live_pieces, model_chunks

__all__ = ["FAMILIES", "BuildOptions", "Family", "Kind", "MegatronSource", "Rule", "build_gpt", "destroy_parallel",
           "family_of", "init_parallel", "live_pieces", "model_chunks", "padded_vocab"]
