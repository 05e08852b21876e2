"""Where every checkpoint tensor lands in an engine's model, learned by tracing the engine's own loader.

An inference engine knows its own layouts: each parameter's weight loader (fused q/k/v offsets and
KV-head replication, gate/up halves, row/column tensor-parallel slices, vocab-parallel padding, MoE
``w13``/``w2`` per local expert) and each model's ``load_weights`` (HF names to fused parameters, tied
embeddings, renames). Rather than re-implement those rules per engine and architecture,
:func:`trace_loads` runs the model's own ``load_weights`` once, at setup, on *meta* tensors: every
loadable tensor is swapped for a meta copy of itself (a :class:`TensorSwap`), every HF tensor is a
meta tensor, and a dispatch mode records each ``copy_`` (which region of which HF tensor lands in
which region of which engine tensor, read off the views' storage offsets and strides) and each
constant ``fill_`` (padding). No byte is allocated or moved; the live model is restored afterwards.

A loader that concatenates HF tensors (``torch.cat``: SGLang fuses DeepSeek's ``q_a_proj`` and
``kv_a_proj_with_mqa`` into one ``fused_qkv_a_proj_with_mqa`` so) is traced through: the
concatenation's pieces are remembered (a :class:`Concat`), and a copy from it is recorded as one
write per HF tensor it spans (also when the loader concatenates slices of its own concatenation
again: SGLang's fused LoRA B, cut per TP rank; a ``clone`` / ``.contiguous()`` of such a box is a
concatenation of one). A write whose source is not a plain box of HF tensors, or any other
mutation of a traced tensor, is recorded as *opaque*, credited to every HF tensor the source was
built from that the tracer can see: its module then takes the loader path (see
:mod:`refit_core.kit.loadplan`), with every such tensor.
Engine plugins (vLLM, SGLang) supply the swap (which tensors, in which format) and share the rest.

This module is the face of four rooms: :mod:`~refit_core.kit.trace_records` (what a trace holds),
:mod:`~refit_core.kit.view_geometry` (views as boxes), :mod:`~refit_core.kit.tensor_swap` (the meta
stand-ins) and :mod:`~refit_core.kit.trace_recorder` (the dispatch mode); :func:`trace_loads` runs them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from refit_core.contract.spec import TensorSpec
from refit_core.kit.tensor_swap import TensorSwap, meta_copy, storage_key
from refit_core.kit.trace_recorder import Concat, ConcatPart, TraceRecorder
from refit_core.kit.trace_records import Fill, Target, Trace, Write
from refit_core.kit.view_geometry import view_as_box

log = logging.getLogger("refit")

__all__ = ["Concat", "ConcatPart", "Fill", "Target", "TensorSwap", "Trace", "TraceRecorder", "Write", "meta_copy",
           "storage_key", "trace_loads", "view_as_box"]


def _named(specs: Iterable[TensorSpec], recorder: TraceRecorder) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in specs:
        yield spec.name, recorder.source(spec)


def trace_loads(model: torch.nn.Module, specs: list[TensorSpec], *,
                swap: Callable[[torch.nn.Module], TensorSwap] = TensorSwap,
                quiet: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Trace:
    """Run ``model.load_weights`` on meta versions of ``specs`` and record where every byte lands.

    ``swap`` builds the meta stand-ins of the model's tensors; ``quiet`` wraps every traced call
    (an engine's completeness checks or logging that have no business in a trace).
    """
    load_weights: Callable[[Iterator[tuple[str, torch.Tensor]]], Any] = getattr(model, "load_weights")
    with swap(model) as swapped:
        trace = Trace(dict(swapped.targets), aliases=dict(swapped.aliases))
        recorder = TraceRecorder(swapped, trace)
        try:
            with quiet(), recorder, torch.no_grad():
                load_weights(_named(specs, recorder))
        except Exception as exc:  # noqa: BLE001 - find which names the model rejects, one by one
            log.debug("traced load_weights failed (%s); tracing tensor by tensor", exc)
            trace = Trace(dict(swapped.targets), aliases=dict(swapped.aliases))
            recorder = TraceRecorder(swapped, trace)
            for spec in specs:
                try:
                    with quiet(), recorder, torch.no_grad():
                        load_weights(_named([spec], recorder))
                except Exception as one:  # noqa: BLE001
                    trace.rejected[spec.name] = f"{type(one).__name__}: {one}"
    return trace
