"""The core's own hook implementations: defaults that plugins may override."""

from __future__ import annotations

import pluggy

from .experts import ExpertName, default_expert_name

hookimpl = pluggy.HookimplMarker("refit")


@hookimpl(trylast=True)
def refit_expert_name(hf_name: str) -> ExpertName | None:
    """The standard ``...experts.{e}.{rest}`` naming."""
    return default_expert_name(hf_name)
