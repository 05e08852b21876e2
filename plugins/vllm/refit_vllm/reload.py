"""Driving vLLM's layerwise reload around a refit step.

After loading, vLLM post-processes weights in place: on x86 CPU every unquantized linear weight
becomes a oneDNN handle and its ``Parameter`` is emptied; quantized layers repack and rescale; some
MoE backends re-layout experts. So a refit cannot write into the live parameters. vLLM's own
machinery (``model_loader/reload/layerwise.py``) gets them back: ``initialize_layerwise_reload`` puts
every layer back into checkpoint format on the meta device (keeping the live "kernel" tensors aside),
a layer is materialized, loaded, post-processed and copied into its kernel tensors, and
``finalize_layerwise_reload`` finishes layers that were not (attention, untouched layers get their
kernel tensors back).

refit drives the same steps, with the loading replaced by its own writes:

- :func:`begin`: ``initialize_layerwise_reload``, then materialize every fast-path module (and zero
  its padding, apply the loaders' constant fills), so destination views point at real memory;
- the core writes the fast-path bytes; the loader path calls the model's ``load_weights``, which
  vLLM's wrapped loaders buffer and process per layer;
- :func:`finish`: post-process each fast-path module exactly as vLLM does for a loaded layer
  (``_layerwise_process``: process weights, copy into the kernel tensors), then
  ``finalize_layerwise_reload``;
- :func:`abort`: a failed step puts every layer's kernel tensors back untouched (the old weights).

``direct`` mode (CUDA, unquantized dense modules whose live tensors *are* checkpoint format, no
loader path) skips all of this: views are the live parameters and nothing needs processing.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch

from refit_core import RefitError, get_plugin_manager
from refit_core.kit import ModelPlan

from .requests import plan_names

log = logging.getLogger("refit.vllm")

DIRECT_SAFE_QUANT = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
REPROCESSABLE = frozenset({"UnquantizedEmbeddingMethod"})
"""Post-processing that only derives kernels from a weight it keeps, so running it again is safe."""


def live_tensor(model: torch.nn.Module, key: tuple[str, str]) -> torch.Tensor | None:
    module = model.get_submodule(key[0])
    tensor = module._parameters.get(key[1])
    return tensor if tensor is not None else module._buffers.get(key[1])


def direct_capable(model: torch.nn.Module, plan: ModelPlan) -> bool:
    """Whether fast-path writes may go straight into live tensors (no post-processing needed)."""
    from vllm.platforms import current_platform

    if plan.loader or not current_platform.is_cuda_alike():
        return False
    for module in plan.fast_modules:
        method = getattr(model.get_submodule(module), "quant_method", None)
        if method is not None and type(method).__name__ not in DIRECT_SAFE_QUANT:
            return False
    fast = set(plan.fast_modules)
    for key, target in plan.targets.items():
        if key[0] not in fast:
            continue
        tensor = live_tensor(model, key)
        if (tensor is None or tensor.is_meta or tuple(tensor.shape) != target.shape
                or tuple(tensor.stride()) != target.stride or tensor.dtype != target.dtype):
            return False
    return True


def _layerwise():
    try:
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.meta import materialize_layer
    except ImportError as exc:  # pragma: no cover - vLLM without layerwise reload
        raise RefitError(f"this vLLM has no layerwise reload ({exc}); refit-plugin-vllm needs vLLM >= 0.32") from exc
    return layerwise, materialize_layer


def _experts_needing_repack(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(quant method, experts) of MoE layers whose kernel-specific repacking a reload would skip.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' own
    ``process_weights_after_loading`` (the CPU grouped-gemm prepack) only on the first load; on a
    reload it copies *unpacked* weights into the prepacked kernel tensors, so every MoE layer
    computes garbage after the first weight update -- through vLLM's own loaders too. refit runs
    the skipped step itself (and only when vLLM did not).
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    found = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is not None and type(experts).process_weights_after_loading is not _base_experts_hook():
            found.append((method, experts))
    return found


def _base_experts_hook() -> Any:
    from vllm.model_executor.layers.fused_moe import modular_kernel

    return modular_kernel.FusedMoEExperts.process_weights_after_loading


def _install_repack(model: torch.nn.Module) -> None:
    for method, experts in _experts_needing_repack(model):
        if "process_weights_after_loading" in vars(method):
            continue
        original = method.process_weights_after_loading

        def process(layer: torch.nn.Module, _original: Any = original, _experts: Any = experts) -> None:
            ran: list[bool] = []
            hook = _experts.process_weights_after_loading
            _experts.process_weights_after_loading = lambda target: (ran.append(True), hook(target))[1]
            try:
                _original(layer)
            finally:
                del _experts.process_weights_after_loading
            if not ran:
                hook(layer)

        method.process_weights_after_loading = process


def _remove_repack(model: torch.nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and "process_weights_after_loading" in vars(method):
            del method.process_weights_after_loading


def begin(model: torch.nn.Module, plan: ModelPlan) -> None:
    """Back to checkpoint format; materialize the fast-path modules so refit can write into them."""
    layerwise, materialize_layer = _layerwise()
    _install_repack(model)
    layerwise.initialize_layerwise_reload(model)
    try:
        for name in plan.fast_modules:
            module = model.get_submodule(name)
            materialize_layer(module, layerwise.get_layerwise_info(module))
        with torch.no_grad():
            for key in plan.zero:
                live_tensor(model, key).zero_()
            for fill in plan.fills:
                fill.dst_box.slice_of(live_tensor(model, fill.target)).fill_(fill.value)
    except BaseException:
        abort(model)
        raise


def finish(model: torch.nn.Module, plan: ModelPlan, model_config: Any, subset: Collection[str] | None = None) -> None:
    """Post-process what refit wrote, then let vLLM finalize every other layer.

    ``subset``: the HF tensors of a subset step (None: all): only the fast-path modules it wrote are
    post-processed (it names each of them whole: :func:`~refit_vllm.requests.check_subset`); the
    others get their kernel tensors back untouched, as after :func:`abort`."""
    layerwise, _ = _layerwise()
    written = None if subset is None else _written_modules(plan, subset)
    for name in plan.fast_modules:
        module = model.get_submodule(name)
        info = layerwise.get_layerwise_info(module)
        if not info.can_load():
            continue
        if written is None or name in written:
            layerwise._layerwise_process(module, info)
        else:
            _restore(layerwise, module, info)
    try:
        layerwise.finalize_layerwise_reload(model, model_config)
    finally:
        _remove_repack(model)
    _reprocess_tied(model, plan)


def _reprocess_tied(model: torch.nn.Module, plan: ModelPlan) -> None:
    """Rebuild what a tied module derived from the shared weight (vLLM's reload leaves it stale).

    vLLM's reload processes a tied tensor only through its first owner (``embed_tokens``); the tied
    ``lm_head`` keeps kernels derived from the old weight (on CPU, a packed GEMM handle), so logits
    would come from the previous weights. Only idempotent methods are re-run.
    """
    for name in plan.tied:
        module = model.get_submodule(name)
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if type(method).__name__ in REPROCESSABLE:
            method.process_weights_after_loading(module)
        else:
            log.warning("refit: %s shares weights with an updated module but its %s cannot be re-run "
                        "safely; its derived kernels may be stale", name, type(method).__name__)


def _written_modules(plan: ModelPlan, subset: Collection[str]) -> set[str]:
    """The fast-path modules a subset step writes (a grouped piece is written if its group is named)."""
    wanted = plan_names(subset, get_plugin_manager().expert_name)
    return {piece.target[0] for piece in plan.pieces if piece.spec.name in wanted}


def _restore(layerwise: Any, module: torch.nn.Module, info: Any) -> None:
    """``module`` gets its kernel tensors back (nothing of it was written) and leaves the reload."""
    if info.kernel_tensors is not None:
        layerwise._place_kernel_tensors(module, info)
    info.reset()


def abort(model: torch.nn.Module) -> None:
    """Undo :func:`begin`: every layer gets its (unchanged) kernel tensors back."""
    layerwise, _ = _layerwise()
    for module in model.modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():
            continue
        _restore(layerwise, module, info)
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()
    _remove_repack(model)
    log.warning("refit: the weight update was aborted; the engine keeps its previous weights")
