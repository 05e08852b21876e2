"""Refusing to serve torn weights: a forward pre-hook that raises until the next successful refit.

A gen plugin whose engine cannot restore the tensors a failed in-place step tore calls
:func:`refuse_serving` from ``refit_abort_update`` and :func:`resume_serving` from
``refit_finish_update``; any forward in between raises a :class:`~refit_core.contract.errors.RefitError`
naming the torn tensors, so no request is ever answered with a mix of two weight versions.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from refit_core.contract.errors import RefitError


class TornWeightsError(RefitError):
    """The model holds weights a failed refit left partly written; refit again before serving."""


class _Guard:
    def __init__(self, module: torch.nn.Module) -> None:
        self.torn: set[str] = set()
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        names = sorted(self.torn)
        raise TornWeightsError(f"refusing to serve: a failed refit left {len(names)} tensor(s) partly written "
                               f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); "
                               "run a successful refit first")


_GUARDS: weakref.WeakKeyDictionary[torch.nn.Module, _Guard] = weakref.WeakKeyDictionary()


def refuse_serving(module: torch.nn.Module, torn: Iterable[str]) -> None:
    """Make every forward of ``module`` raise :class:`TornWeightsError` until :func:`resume_serving`."""
    guard = _GUARDS.get(module)
    if guard is None:
        guard = _GUARDS[module] = _Guard(module)
    guard.torn.update(torn)


def resume_serving(module: torch.nn.Module) -> None:
    """A refit succeeded: ``module`` serves again (no-op when it was never refused)."""
    guard = _GUARDS.pop(module, None)
    if guard is not None:
        guard.handle.remove()


def torn_tensors(module: torch.nn.Module) -> set[str]:
    """The tensors ``module`` refuses to serve (empty: it serves)."""
    guard = _GUARDS.get(module)
    return set(guard.torn) if guard is not None else set()
