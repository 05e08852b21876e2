"""refit's standard way to shard a ``transformers`` decoder with DTensor: TP plan, FSDP2, mesh.

The plugin reads *any* DTensor layout from the placements of a live model; this module is only
the layout that ``refit demo``, the tests and the metadata-only ``refit plan`` (``layout.py``)
assume for a ``dtensor:fsdp=F,tp=T,dp=D`` layout, torchtitan style:

- the device mesh is ``(dp, fsdp, tp)``, row-major, so **global rank = (dp_i * F + fsdp_i) * T + tp_i**
  (tp is the fastest-varying coordinate, dp the slowest);
- tensor parallel on the ``tp`` mesh (``parallelize_module``): q/k/v, gate/up (and Mixtral w1/w3)
  column-parallel (``Shard(0)``), o/down (w2) row-parallel (``Shard(1)``), ``embed_tokens``
  row-parallel over the vocabulary and ``lm_head`` column-parallel (both ``Shard(0)``; left
  replicated when the embeddings are tied, which TP would untie), fused MoE experts sharded on the
  expert dimension (``Shard(0)``: expert parallelism over the tp ranks, as a storage layout only:
  transformers' experts forward has no DTensor token dispatch, so such a model refits but does not
  run a forward; FSDP2 alone does), everything else replicated;
- FSDP2 (``fully_shard``) on every decoder layer and the root over the ``fsdp`` mesh dimension
  (``Shard(0)``; ``_StridedShard(0)`` where TP already shards dim 0), as HSDP over ``(dp, fsdp)``
  when ``dp > 1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from refit_core import ParallelLayout, PluginError

MESH_DIMS = ("dp", "fsdp", "tp")
COLWISE = "colwise"
ROWWISE = "rowwise"
EMBEDDING = "embedding"
LM_HEAD = "lm_head"
EXPERTS = "experts"

_COLWISE_LEAVES = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"}
_ROWWISE_LEAVES = {"o_proj", "down_proj", "w2"}


def check_layout(layout: ParallelLayout) -> None:
    """Only ``fsdp``, ``tp`` and ``dp`` are DTensor layout keys here."""
    extra = {k: getattr(layout, k) for k in ("pp", "vpp", "ep", "etp") if getattr(layout, k) != 1}
    if extra:
        raise PluginError(f"dtensor layouts take fsdp, tp and dp only (MoE experts are sharded over tp); "
                          f"got {extra}")


def rank_coordinate(layout: ParallelLayout, rank: int) -> tuple[int, int, int]:
    """``(dp_i, fsdp_i, tp_i)`` of a global rank (see the module docstring)."""
    if not 0 <= rank < layout.world_size:
        raise PluginError(f"rank {rank} outside a {layout} layout of {layout.world_size} ranks")
    return rank // (layout.fsdp * layout.tp), rank // layout.tp % layout.fsdp, rank % layout.tp


def tp_style(name: str, module: nn.Module, tied: bool) -> str | None:
    """How the standard TP plan treats a module (by its name and kind), or None: replicated."""
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Linear):
        if leaf in _COLWISE_LEAVES:
            return COLWISE
        if leaf in _ROWWISE_LEAVES:
            return ROWWISE
        if leaf == "lm_head":
            return None if tied else LM_HEAD
        return None
    if isinstance(module, nn.Embedding) and leaf == "embed_tokens":
        return None if tied else EMBEDDING
    if leaf == "experts" and any(p.ndim == 3 for p in module.parameters(recurse=False)):
        return EXPERTS
    return None


def tp_shard_dim(style: str | None, param_leaf: str) -> int | None:
    """The tensor dimension the standard TP plan shards a parameter on, or None."""
    if style in (COLWISE, EMBEDDING, LM_HEAD, EXPERTS):
        return 0
    if style == ROWWISE and param_leaf == "weight":
        return 1
    return None


def is_tied(model: Any) -> bool:
    from .names import tied_targets
    return bool(tied_targets(model))


def _expert_style() -> Any:
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class _ExpertParallel(ParallelStyle):
        """Shard every parameter of a fused-experts module on the expert dimension (dim 0)."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def partition(_name: str, mod: nn.Module, mesh: Any) -> None:
                for pname, param in list(mod.named_parameters(recurse=False)):
                    mod.register_parameter(pname, nn.Parameter(
                        distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad))
            return distribute_module(module, device_mesh, partition)

    return _ExpertParallel()


def tp_plan(model: nn.Module, *, shard_tied_embeddings: bool = False) -> dict[str, Any]:
    """The standard plan for ``parallelize_module`` (module name -> ParallelStyle).

    ``shard_tied_embeddings`` shards tied ``embed_tokens`` / ``lm_head`` anyway, as plans written
    for untied models do: that splits the tie into two tensors (a refit destination keeps the
    copy in sync in ``refit_finish_update``; a trainer would train them apart).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    tied = is_tied(model) and not shard_tied_embeddings
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        style = tp_style(name, module, tied)
        if style == COLWISE:
            plan[name] = ColwiseParallel()
        elif style == ROWWISE:
            plan[name] = RowwiseParallel()
        elif style == EMBEDDING:
            plan[name] = RowwiseParallel(input_layouts=Replicate())
        elif style == LM_HEAD:
            plan[name] = ColwiseParallel(output_layouts=Replicate())
        elif style == EXPERTS:
            plan[name] = _expert_style()
    return plan


def init_mesh(layout: ParallelLayout, device_type: str = "cpu") -> Any:
    """The ``(dp, fsdp, tp)`` device mesh of the default process group (``world_size`` ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    check_layout(layout)
    return init_device_mesh(device_type, (layout.dp, layout.fsdp, layout.tp), mesh_dim_names=MESH_DIMS)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks (each gets its own FSDP2 unit)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def shard_model(model: nn.Module, layout: ParallelLayout, mesh: Any, *, mp_policy: Any | None = None,
                shard_tied_embeddings: bool = False) -> nn.Module:
    """Apply the standard TP plan and FSDP2 to ``model`` in place (see the module docstring).

    ``mp_policy`` is FSDP2's ``MixedPrecisionPolicy`` (sharded parameters stay in their dtype,
    e.g. fp32 master weights, which is what refit reads).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    check_layout(layout)
    if layout.tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model, shard_tied_embeddings=shard_tied_embeddings))
    if layout.dp * layout.fsdp > 1:
        dp_mesh = mesh["dp", "fsdp"] if layout.dp > 1 else mesh["fsdp"]
        kwargs = {"mesh": dp_mesh}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    return model


def build_model(config: dict[str, Any] | Any, *, dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu", seed: int | None = 0) -> nn.Module:
    """A ``transformers`` causal LM from a config (dict or ``PretrainedConfig``), random weights
    drawn after ``torch.manual_seed(seed)`` (``seed=None`` leaves the global generator alone)."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        values = dict(config)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype else \
            AutoModelForCausalLM.from_config(config)
    return model.eval()
