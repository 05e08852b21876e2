"""The core's own hook implementations: defaults that plugins may override."""

from __future__ import annotations

from refit_core.contract.experts import ExpertName, default_expert_name, default_member_name
from refit_core.contract.hookspecs import hookimpl


@hookimpl(trylast=True)
def refit_expert_name(hf_name: str) -> ExpertName | None:
    """The standard ``...experts.{e}.{rest}`` naming."""
    return default_expert_name(hf_name)


@hookimpl(trylast=True)
def refit_expert_member_name(group: str, index: int) -> str | None:
    """The inverse of the standard naming: ``...experts.{rest}`` -> ``...experts.{index}.{rest}``."""
    return default_member_name(group, index)
