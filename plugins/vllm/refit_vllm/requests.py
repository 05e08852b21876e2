"""What refit accepts in vLLM's weight-transfer calls, and the errors it raises where vLLM's API names them.

vLLM's ``nccl`` backend's ``update_info`` names the tensors of a step (``names``, ``dtype_names``,
``shapes``); refit's plan already knows them, so refit takes such a list as a claim to check: every
name must be an HF tensor of the engine's checkpoint, its shape that tensor's full shape and its
dtype one refit can send into it (any floating dtype into a floating or quantized tensor, refit
casts; exactly the tensor's dtype otherwise). A list that names every tensor is a whole step; a
strict subset is refused (refit moves its whole plan each step), naming what it leaves out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from refit_core import RefitError, TensorSpec

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


def check_step(tensors: Sequence[NamedTensor], catalog: Mapping[str, TensorSpec]) -> None:
    """Hold the tensors an ``update_info`` names against ``catalog`` (the HF tensors refit's plan moves
    into this engine): raise :class:`InvalidRequestError` naming the first mismatches, else return (the
    list is a whole step)."""
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
    named = {t.name for t in tensors}
    left_out = [n for n in catalog if n not in named]
    if left_out:
        raise InvalidRequestError(
            f"update_info names {len(named)} of the {len(catalog)} tensors refit's plan moves; refit moves "
            f"every tensor of its plan each step (left out: {', '.join(left_out[:SHOWN])}"
            f"{' ...' if len(left_out) > SHOWN else ''}): name them all, or none")


__all__ = ["InvalidRequestError", "NamedTensor", "check_step", "dtype_named", "named_tensors"]
