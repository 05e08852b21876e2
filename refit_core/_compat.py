"""Import paths from before the move into role subpackages, kept until 0.3: each warns and hands back the moved module.

The plugin guide before the move let plugins import ``refit_core.spec``, ``.pieces``,
``.experts``, ``.boxindex``, ``.env``, ``.models``, ``.verify``, ``.launch`` and ``.demo.context``, and
its example imported ``Quantization`` from ``refit_core.quant``.
Those modules now live in role subpackages; the names they held import from :mod:`refit_core` and
:mod:`refit_core.kit` (those that left the kit's ``__all__`` since warn again there, naming
:mod:`refit_core.apps` or what replaces them). A plugin written against that guide keeps working unchanged;
a :class:`DeprecationWarning` names the new place. Names that left a public module's ``__all__`` since
(refit 0.3's smaller surface) keep importing from it the same way, through :func:`moved_names`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

MOVED: dict[str, tuple[str, str]] = {
    # old path: (module it is now, where its public names are imported from)
    "refit_core.spec": ("refit_core.contract.spec", "refit_core"),
    "refit_core.pieces": ("refit_core.contract.pieces", "refit_core"),
    "refit_core.experts": ("refit_core.contract.experts", "refit_core"),
    "refit_core.quant": ("refit_core.contract.spec", "refit_core"),
    "refit_core.boxindex": ("refit_core.plan.regions", "refit_core.kit"),
    "refit_core.env": ("refit_core.contract.env", "refit_core.kit"),
    "refit_core.models": ("refit_core.kit.models", "refit_core.kit"),
    "refit_core.verify": ("refit_core.kit.verify", "refit_core.kit"),
    "refit_core.launch": ("refit_core.kit.launch", "refit_core.kit"),
    "refit_core.demo": ("refit_core.tools.demo", "refit_core.kit"),
    "refit_core.demo.context": ("refit_core.kit.demo", "refit_core.kit"),
}
"""Each old module path: the module it is now, and the public module to import its names from."""


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module that now holds its code (one module object, two names)."""

    def __init__(self, old: str) -> None:
        self.old = old
        self.target, self.public = MOVED[old]

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} moved: import its names from {self.public} ({self.old} goes away in refit 0.3)",
                      DeprecationWarning, stacklevel=4)
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the alias' spec on the shared module


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds only the old paths in :data:`MOVED`."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname))


def install() -> None:
    """Let the old paths import (idempotent)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def moved_names(public: str, moved: Mapping[str, tuple[str, str]],
                lazy: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for public module ``public``: the names that left its ``__all__`` still import.

    ``moved`` maps each name to (the module that holds it, ``module:attr`` where it is named otherwise there, and
    where to take it from now); every access warns
    with a :class:`DeprecationWarning` naming that place. ``lazy`` maps names of the module's own
    ``__all__`` whose module is heavy (Ray, pytest) to that module: loaded on first access, without a warning.
    """
    lazy = lazy or {}

    def __getattr__(name: str) -> Any:
        if name in lazy:
            return getattr(importlib.import_module(lazy[name]), name)
        if name not in moved:
            raise AttributeError(f"module {public!r} has no attribute {name!r}")
        where, instead = moved[name]
        module, _, attr = where.partition(":")
        warnings.warn(f"{public}.{name} left the public surface: {instead} ({public}.{name} goes away in refit 0.3)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), attr or name)

    return __getattr__
