"""verl's Megatron actor as a refit source, through refit-plugin-megatron's mapping (no full-tensor gather).

verl's ``MegatronEngine`` (``actor.strategy=megatron``) holds its model as megatron-core chunks (``engine.module``:
one ``GPTModel`` per virtual pipeline stage, inside megatron's ``DistributedDataParallel`` and ``Float16Module``)
built by mbridge or Megatron-Bridge from the HF checkpoint ``engine.model_config`` names. refit reads each rank's
tensor / pipeline / expert shards in place as views of those parameters (:class:`refit_megatron.MegatronSource`),
where verl's own sync (``engine.get_per_tensor_param()``) all-gathers every tensor-parallel weight whole.
Needs refit-plugin-megatron (the ``megatron`` extra; from this checkout ``pip install -e plugins/megatron``) and
megatron-core, imported only for a Megatron engine.
"""

from __future__ import annotations

import weakref
from typing import Any

from refit_core import PluginError, SourcePiece

_SOURCES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""One :class:`~refit_megatron.MegatronSource` per engine: it caches the listing of the chunks' tensors."""


def is_megatron_engine(engine: Any) -> bool:
    """Whether a verl training engine is its Megatron engine (``engine_config.strategy == "megatron"``)."""
    return getattr(getattr(engine, "engine_config", None), "strategy", None) == "megatron"


def megatron_source(engine: Any) -> Any:
    """The engine's megatron-core chunks as a :class:`~refit_megatron.MegatronSource`, named by its HF config.

    Refuses a LoRA actor (verl's Megatron PEFT adapters live in Megatron-Bridge's own modules, which
    refit-plugin-megatron does not map) and an engine not built yet (``initialize()`` makes ``module``)."""
    try:
        from refit_megatron import MegatronSource
    except ImportError as missing:
        raise PluginError("verl's Megatron actor: refit reads it through refit-plugin-megatron, which is not "
                          "installed (from this checkout: pip install -e plugins/megatron)") from missing
    if getattr(engine, "peft_cls", None) is not None:
        raise PluginError("verl's Megatron actor with LoRA: refit moves its base weights only through "
                          "refit-plugin-megatron, which maps no Megatron-Bridge adapter; use the FSDP2 actor for LoRA")
    chunks = getattr(engine, "module", None)
    if not chunks:
        raise PluginError("verl's Megatron actor holds no model yet (the engine builds it in initialize())")
    source = _SOURCES.get(engine)
    if source is None or source.model is not chunks:
        source = _SOURCES[engine] = MegatronSource(chunks, engine.model_config.hf_config.to_dict())
    return source


def megatron_pieces(engine: Any) -> list[SourcePiece]:
    """This rank's source pieces of a Megatron engine: views of its local shards (refit-plugin-megatron's)."""
    from refit_megatron import live_pieces

    return live_pieces(megatron_source(engine))


def megatron_tensors(engine: Any) -> list[tuple[str, Any]]:
    """The parameters and buffers the pieces view, listed cheaply before every step (refit's moved-memory check)."""
    from refit_megatron.source import model_tensors

    return model_tensors(megatron_source(engine))
