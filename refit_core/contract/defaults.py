"""The core's own hook implementations: defaults that plugins may override."""

from __future__ import annotations

from typing import Any

from refit_core.contract.experts import ExpertName, default_expert_name, default_member_name
from refit_core.contract.hookspecs import hookimpl
from refit_core.contract.lora import AdapterReceiver
from refit_core.contract.pieces import DestinationMap


@hookimpl(trylast=True)
def refit_expert_name(hf_name: str) -> ExpertName | None:
    """The standard ``...experts.{e}.{rest}`` naming."""
    return default_expert_name(hf_name)


@hookimpl(trylast=True)
def refit_expert_member_name(group: str, index: int) -> str | None:
    """The inverse of the standard naming: ``...experts.{rest}`` -> ``...experts.{index}.{rest}``."""
    return default_member_name(group, index)


@hookimpl(trylast=True)
def refit_destination_map(model: Any) -> DestinationMap | None:
    """An adapter-mode receiver's slots (:class:`~refit_core.contract.lora.AdapterReceiver`)."""
    return model.destination_map() if isinstance(model, AdapterReceiver) else None


@hookimpl(trylast=True)
def refit_begin_update(model: Any) -> bool | None:
    """An adapter-mode receiver saves what the step overwrites; its views stay valid (False)."""
    if not isinstance(model, AdapterReceiver):
        return None
    model.begin()
    return False


@hookimpl(trylast=True)
def refit_finish_update(model: Any, version: int) -> bool | None:
    if not isinstance(model, AdapterReceiver):
        return None
    model.finish(version)
    return True


@hookimpl(trylast=True)
def refit_abort_update(model: Any, torn: list[str]) -> bool | None:
    """An adapter-mode receiver puts back what the step overwrote (True: restored)."""
    if not isinstance(model, AdapterReceiver):
        return None
    model.abort()
    return True
