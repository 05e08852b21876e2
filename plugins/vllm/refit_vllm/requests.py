"""What refit accepts in vLLM's weight-transfer calls, and the errors it raises where vLLM's API names them.

vLLM's ``nccl`` backend's ``update_info`` names the tensors of a step (``names``, ``dtype_names``,
``shapes``); refit's plan already knows them, so refit takes such a list as a claim to check: every
name must be an HF tensor of the engine's checkpoint, its shape that tensor's full shape and its
dtype one refit can send into it (any floating dtype into a floating or quantized tensor, refit
casts; exactly the tensor's dtype otherwise). A list that names every tensor is a whole step; a
strict subset is a subset step (refit's own spelling, from its trainer side: ``only``, names
without claims): refit moves exactly those tensors, through a sub-schedule of its plan, and the
engine's other tensors keep their bytes. Where vLLM post-processes a module from all the tensors it
holds (reload mode: every CPU engine, quantized layers; the loader path), a subset must name such a
fused group whole (``q_proj``, ``k_proj``, ``v_proj`` of one ``qkv_proj``), else it is refused,
naming the module and what it leaves out (:func:`check_subset`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from refit_core import ExpertName, RefitError, TensorSpec
from refit_core.kit import ModelPlan

SHOWN = 5
"""How many offending names an error lists."""


class InvalidRequestError(RefitError, ValueError):
    """A weight-transfer call refit refuses: also the ``ValueError`` vLLM's own backends raise for it."""


@dataclass(frozen=True)
class NamedTensor:
    """One tensor an ``update_info`` names: HF name, the dtype the trainer sends, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype ``name`` spells (``"bfloat16"``, ``"torch.float32"``)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"update_info dtype_names holds {name!r}, which is not a torch dtype")
    return dtype


def named_tensors(names: Sequence[str] | None, dtype_names: Sequence[str] | None,
                  shapes: Sequence[Sequence[int]] | None) -> tuple[NamedTensor, ...] | None:
    """The tensors an ``update_info`` names, or None if it names none (all three lists absent).

    Lists of different lengths, or one given without the others, raise :class:`InvalidRequestError`
    naming the list, as vLLM's ``NCCLWeightTransferUpdateInfo`` does."""
    given = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if all(v is None for v in given.values()):
        return None
    absent = [k for k, v in given.items() if v is None]
    if absent:
        raise InvalidRequestError(f"update_info gives {', '.join(k for k in given if k not in absent)} "
                                  f"without {', '.join(absent)}: give names, dtype_names and shapes together")
    assert names is not None and dtype_names is not None and shapes is not None
    for key in ("dtype_names", "shapes"):
        if len(given[key]) != len(names):  # type: ignore[arg-type]
            raise InvalidRequestError(f"`{key}` should be of the same size as `names`: got "
                                      f"{len(given[key])} and {len(names)}")  # type: ignore[arg-type]
    twice = sorted(n for n, count in Counter(names).items() if count > 1)
    if twice:
        raise InvalidRequestError(f"update_info names {', '.join(twice[:SHOWN])} more than once")
    return tuple(NamedTensor(str(n), dtype_named(d), tuple(int(x) for x in s))
                 for n, d, s in zip(names, dtype_names, shapes))


def _sendable(dtype: torch.dtype, spec: TensorSpec) -> bool:
    if spec.quant is not None or spec.dtype.is_floating_point:
        return dtype.is_floating_point
    return dtype == spec.dtype


def check_step(tensors: Sequence[NamedTensor], catalog: Mapping[str, TensorSpec]) -> frozenset[str] | None:
    """Hold the tensors an ``update_info`` names against ``catalog`` (the HF tensors refit's plan moves
    into this engine): raise :class:`InvalidRequestError` naming the first mismatches; else return the
    names if they are a strict subset of the catalog, None if they name every tensor (a whole step)."""
    unknown = [t.name for t in tensors if t.name not in catalog]
    if unknown:
        raise InvalidRequestError(f"update_info names {len(unknown)} tensor(s) the engine's checkpoint does not "
                                  f"have: {', '.join(unknown[:SHOWN])}")
    shapes = [f"{t.name} {list(t.shape)} (the engine's is {list(catalog[t.name].shape)})"
              for t in tensors if t.shape != catalog[t.name].shape]
    if shapes:
        raise InvalidRequestError(f"update_info gives the wrong full shape for {len(shapes)} tensor(s): "
                                  f"{'; '.join(shapes[:SHOWN])}")
    dtypes = [f"{t.name} {str(t.dtype).removeprefix('torch.')} (the engine's is "
              f"{str(catalog[t.name].dtype).removeprefix('torch.')})"
              for t in tensors if not _sendable(t.dtype, catalog[t.name])]
    if dtypes:
        raise InvalidRequestError(f"update_info gives a dtype refit cannot send into {len(dtypes)} tensor(s): "
                                  f"{'; '.join(dtypes[:SHOWN])}")
    named = frozenset(t.name for t in tensors)
    return None if len(named) == len(catalog) else named


def step_names(tensors: Sequence[NamedTensor] | None, only: Sequence[str] | None,
               catalog: Mapping[str, TensorSpec]) -> frozenset[str] | None:
    """The tensors one step moves: the names ``update_info`` claims (:func:`check_step`) and its
    ``only`` list (refit's trainer side: names without claims), which must agree where both are
    given; None for a whole step."""
    if only is not None:
        if isinstance(only, str) or not all(isinstance(n, str) for n in only):
            raise InvalidRequestError("update_info only must be a list of tensor names")
        unknown = [n for n in only if n not in catalog]
        if unknown:
            raise InvalidRequestError(f"update_info only names {len(unknown)} tensor(s) the engine's checkpoint "
                                      f"does not have: {', '.join(unknown[:SHOWN])}")
    claimed = None if tensors is None else (check_step(tensors, catalog) or frozenset(catalog))
    listed = None if only is None else frozenset(only)
    if claimed is not None and listed is not None and claimed != listed:
        differ = sorted(claimed ^ listed)
        raise InvalidRequestError(f"update_info names and only disagree on {len(differ)} tensor(s): "
                                  f"{', '.join(differ[:SHOWN])}")
    names = claimed if claimed is not None else listed
    if names is None or len(names) == len(catalog):
        return None
    if not names:
        raise InvalidRequestError("update_info names no tensor: name at least one, or leave the lists out")
    return names


def plan_names(names: Collection[str], namer: Callable[[str], ExpertName | None]) -> set[str]:
    """``names`` (HF names) as the destination plan names its pieces: an expert by its grouped tensor."""
    return {expert.group if (expert := namer(n)) is not None else n for n in names}


def check_subset(names: Collection[str], plan: ModelPlan, namer: Callable[[str], ExpertName | None], *,
                 reload: bool) -> None:
    """Refuse a subset (HF names) that splits what vLLM processes whole, naming it: in ``reload`` mode a
    fast-path module (a fused ``qkv_proj`` or ``gate_up_proj``, a module of grouped experts) is
    post-processed from every tensor it holds, so a subset names all of its tensors or none; the
    loader path hands vLLM's loaders whole tensors whose layers it processes once every part of them
    has loaded, so a subset names all of the loader path's tensors or none."""
    wanted = plan_names(names, namer)
    if reload:
        feeds: dict[str, set[str]] = {}
        for piece in plan.pieces:
            feeds.setdefault(piece.target[0], set()).add(piece.spec.name)
        split = [(module, sorted(tensors - wanted)) for module, tensors in sorted(feeds.items())
                 if tensors & wanted and not tensors <= wanted]
        if split:
            shown = "; ".join(f"{module} (leaves out {', '.join(left[:SHOWN])})" for module, left in split[:SHOWN])
            raise InvalidRequestError(
                f"update_info names a subset that splits {len(split)} vLLM module(s) post-processed whole: {shown}; "
                "name every tensor of each such module, or none of them")
    loader = {spec.name for spec in plan.loader}
    if loader & wanted and not loader <= wanted:
        left = sorted(loader - wanted)
        raise InvalidRequestError(
            f"update_info names {len(loader & wanted)} of the {len(loader)} loader-path tensors (leaves out "
            f"{', '.join(left[:SHOWN])}): vLLM's loaders process a layer once all of it has loaded; name every "
            "loader-path tensor, or none")


__all__ = ["InvalidRequestError", "NamedTensor", "check_step", "check_subset", "dtype_named", "named_tensors",
           "plan_names", "step_names"]
