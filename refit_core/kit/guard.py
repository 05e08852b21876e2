"""Refusing to serve: one forward pre-hook per module that raises while the module must not serve.

Two reasons share the hook, each set and lifted on its own:

- *torn weights*: a gen plugin whose engine cannot restore the tensors a failed in-place step tore calls
  :func:`refuse_serving` from ``refit_abort_update`` and :func:`resume_serving` from
  ``refit_finish_update``; a forward in between raises :class:`TornWeightsError` naming the torn tensors.
- *the engine's verdict*: after each step an engine's ranks agree whether it may serve
  (:mod:`refit_core.kit.serving`); :func:`refuse_engine` / :func:`resume_engine` set and lift that
  verdict, which a forward raises first, as :class:`EngineRefusesError`.

So no request is ever answered with a mix of two weight versions.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from refit_core.contract.errors import RefitError


class TornWeightsError(RefitError):
    """The model holds weights a failed refit left partly written; refit again before serving."""


class EngineRefusesError(RefitError):
    """The engine's ranks hold different weight versions, or one needs a refit: serve nothing until a
    refit lands on every rank."""


class _Guard:
    def __init__(self, module: torch.nn.Module) -> None:
        self.torn: set[str] = set()
        self.verdict: str | None = None
        self.handle = module.register_forward_pre_hook(self, prepend=True)

    @property
    def idle(self) -> bool:
        return not self.torn and self.verdict is None

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.verdict is not None:
            raise EngineRefusesError(self.verdict)
        names = sorted(self.torn)
        raise TornWeightsError(f"refusing to serve: a failed refit left {len(names)} tensor(s) partly written "
                               f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); "
                               "run a successful refit first")


_GUARDS: weakref.WeakKeyDictionary[torch.nn.Module, _Guard] = weakref.WeakKeyDictionary()


def _guard(module: torch.nn.Module) -> _Guard:
    guard = _GUARDS.get(module)
    if guard is None:
        guard = _GUARDS[module] = _Guard(module)
    return guard


def _release_if_idle(module: torch.nn.Module) -> None:
    guard = _GUARDS.get(module)
    if guard is not None and guard.idle:
        del _GUARDS[module]
        guard.handle.remove()


def refuse_serving(module: torch.nn.Module, torn: Iterable[str]) -> None:
    """Make every forward of ``module`` raise :class:`TornWeightsError` until :func:`resume_serving`."""
    _guard(module).torn.update(torn)


def resume_serving(module: torch.nn.Module) -> None:
    """A refit succeeded: ``module``'s weights are whole again (no-op when none were torn). An engine
    verdict set by :func:`refuse_engine` stays until :func:`resume_engine`."""
    guard = _GUARDS.get(module)
    if guard is not None:
        guard.torn.clear()
        _release_if_idle(module)


def torn_tensors(module: torch.nn.Module) -> set[str]:
    """The torn tensors ``module`` refuses to serve (empty: none)."""
    guard = _GUARDS.get(module)
    return set(guard.torn) if guard is not None else set()


def refuse_engine(module: torch.nn.Module, message: str) -> None:
    """Make every forward of ``module`` raise :class:`EngineRefusesError` with ``message`` (before any torn
    weights are named) until :func:`resume_engine`; replaces an earlier verdict."""
    _guard(module).verdict = message


def resume_engine(module: torch.nn.Module) -> None:
    """The engine's ranks agree again: lift the verdict on ``module`` (no-op when none was set; torn
    weights named by :func:`refuse_serving` still refuse)."""
    guard = _GUARDS.get(module)
    if guard is not None:
        guard.verdict = None
        _release_if_idle(module)


def engine_refusal(module: torch.nn.Module) -> str | None:
    """The engine verdict ``module`` refuses to serve with; None when there is none (its torn weights, if
    any, are :func:`torn_tensors`)."""
    guard = _GUARDS.get(module)
    return None if guard is None else guard.verdict
