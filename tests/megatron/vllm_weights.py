"""What a vLLM model's parameters hold as loaded, before vLLM post-processes them (test helper).

On CPU vLLM turns every linear weight into a oneDNN handle and prepacks MoE experts after loading,
so the live parameters cannot be compared. Every load, refit's included, goes through vLLM's
layerwise reload, which hands each layer to ``layerwise._layerwise_process`` with its parameters
in vLLM's own (fused, sharded) layout and then runs the layer's ``process_weights_after_loading``.
:class:`LoadedWeights` records every parameter there, just before that processing.

The reference is vLLM's own: :func:`reload_reference` loads an HF checkpoint through the worker's
``reload_weights`` (``initialize_layerwise_reload`` -> the model's ``load_weights`` ->
``finalize_layerwise_reload``), recorded the same way, so a refit is compared bitwise with what
vLLM's loaders make of the reference checkpoint, parameter by parameter, without refit's maps.
The engine must run in this process (TP 1, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from refit_core.apps import same_bytes


class LoadedWeights:
    """Records ``{parameter name: values}`` of every layer vLLM processes while active."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.names = {module: name for name, module in model.named_modules()}
        self.tensors: dict[str, torch.Tensor] = {}

    def _record(self, layer: torch.nn.Module) -> None:
        prefix = self.names.get(layer)
        if prefix is None:
            return
        for name, param in layer.named_parameters(recurse=False):
            if not param.is_meta:
                self.tensors[f"{prefix}.{name}" if prefix else name] = param.detach().clone()

    @contextlib.contextmanager
    def recording(self) -> Iterator[LoadedWeights]:
        """Patch vLLM's per-layer processing for the duration (this process's engine only)."""
        from vllm.model_executor.model_loader.reload import layerwise

        original = layerwise._layerwise_process
        recorder = self

        def process(layer: torch.nn.Module, info: Any) -> None:
            method = getattr(layer, "quant_method", None)
            if method is None or not callable(getattr(method, "process_weights_after_loading", None)):
                original(layer, info)
                recorder._record(layer)  # nothing processes it: what was loaded stays
                return
            own = vars(method).get("process_weights_after_loading")
            inner = method.process_weights_after_loading

            def before_processing(target: torch.nn.Module) -> None:
                recorder._record(target)
                inner(target)

            method.process_weights_after_loading = before_processing
            try:
                original(layer, info)
            finally:
                if own is None:
                    del method.process_weights_after_loading
                else:
                    method.process_weights_after_loading = own

        layerwise._layerwise_process = process
        try:
            yield self
        finally:
            layerwise._layerwise_process = original


def engine_model(llm: Any) -> torch.nn.Module:
    """The model of an in-process TP-1 ``LLM``."""
    return llm.collective_rpc(_model)[0]


def _model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def reload_reference(llm: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load HF ``tensors`` with vLLM's own ``reload_weights``; what its loaders put in every parameter."""
    recorder = LoadedWeights(engine_model(llm))
    with recorder.recording():
        llm.collective_rpc(_reload, args=(tensors,))
    return recorder.tensors


def _reload(worker: Any, tensors: dict[str, torch.Tensor]) -> None:
    worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()))


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Parameters missing on either side or not bitwise equal (dtype, shape and bytes)."""
    out = [f"{n}: only in the refit" for n in sorted(set(got) - set(want))]
    out += [f"{n}: not written by the refit" for n in sorted(set(want) - set(got))]
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if not same_bytes(a, b):
            out.append(f"{name}: differs")
    return out
