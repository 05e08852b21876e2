"""The hook a plugin implements to offer ``refit demo`` programs: declared by the kit, not the contract.

The contract's plugin manager knows nothing of demos; :func:`refit_core.kit.demo.installed_demos` adds
this module's hook to it when ``refit demo`` (or the conformance kit) needs it. Plugins implement it with
``refit_core.hookimpl`` like every other hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from refit_core.contract.hookspecs import hookspec

if TYPE_CHECKING:
    from refit_core.kit.demo import DemoPrograms

REGISTER_DEMOS = "refit_register_demos"


@hookspec
def refit_register_demos(register: Callable[[DemoPrograms], None]) -> None:
    """Register what ``refit demo`` runs for your backends by calling ``register(DemoPrograms(...))``.

    One :class:`~refit_core.kit.demo.DemoPrograms` per backend (named as in ``refit_register_backends``):
    its train and gen programs, default layouts, priority, Ray actors and quantized destinations.
    """
