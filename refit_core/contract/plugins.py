"""The plugin manager: entry-point discovery, selection by environment, and hook calls that fail clearly."""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from refit_core.contract import defaults, hookspecs
from refit_core.contract.backend import Backend
from refit_core.contract.env import PLUGINS as PLUGINS_ENV
from refit_core.contract.env import plugin_selection, read
from refit_core.contract.errors import PluginError
from refit_core.contract.experts import ExpertName, ExpertNaming
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.pieces import DestinationMap, SourcePiece

if TYPE_CHECKING:
    import torch

    from refit_core.contract.lora import LoraSpec

ENTRY_POINT_GROUP = "refit"
REGISTER_BACKENDS = "refit_register_backends"

log = logging.getLogger("refit")


@dataclass
class PluginInfo:
    """A registered plugin: its name, the distribution that ships it, and its backends."""

    name: str
    distribution: str
    version: str
    backends: list[Backend] = field(default_factory=list)


EXPERT_NAMES_KEPT = 1 << 20
"""The most expert-naming answers a plugin manager keeps (names of about 50 models the size of DeepSeek-V3)."""


class PluginManager:
    """refit's hook caller. ``get_plugin_manager()`` returns the process-wide instance."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._pm = pluggy.PluginManager("refit")
        self._pm.add_hookspecs(hookspecs)
        self._pm.register(defaults, name="refit-core-defaults")
        self._specs: set[str] = {hookspecs.__name__}
        self._info: dict[str, PluginInfo] = {}
        self._expert_names: dict[str, ExpertName | None] = {}
        """Answers of the expert-naming hook so far (a setup asks about each of a model's tensors several
        times: 19,000 names cost seconds through pluggy); emptied when a plugin registers."""
        self.broken: dict[str, str] = {}
        """Plugins whose import failed: name -> error (they are skipped, and named in errors)."""
        if load_entry_points:
            self._load_entry_points()

    # -- registration -------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        allowed = plugin_selection()
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if (allowed is not None and ep.name not in allowed) or self.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not take the others down
                self.broken[ep.name] = f"{type(exc).__name__}: {exc}"
                log.warning("refit plugin %r (%s) failed to import and is skipped: %s", ep.name, ep.value, exc)
                continue
            dist = ep.dist
            self.register(plugin, name=ep.name,
                          distribution=dist.name if dist else "?", version=dist.version if dist else "?")

    def register(self, plugin: Any, name: str, distribution: str = "(registered in code)",
                 version: str = "") -> None:
        """Register a plugin object or module by hand (tests, notebooks, in-tree backends)."""
        self._pm.register(plugin, name=name)
        self._expert_names.clear()
        self._info[name] = PluginInfo(name, distribution, version, self._registered_by(REGISTER_BACKENDS, name))

    def add_hookspecs(self, specs: ModuleType | type) -> None:
        """Declare the hooks of ``specs``, a module or a class of a layer above the contract's (e.g. the kit's
        demo hook, :class:`refit_core.kit.demo.DemoHookspecs`).

        Plugins registered before implement them too (pluggy checks their signatures now). Adding the same
        specs twice does nothing.
        """
        key = f"{specs.__module__}.{specs.__qualname__}" if isinstance(specs, type) else specs.__name__
        if key not in self._specs:
            self._pm.add_hookspecs(specs)
            self._specs.add(key)

    def registrations(self, hook: str) -> dict[str, list[Any]]:
        """What each plugin registers through ``hook``, a hook taking a ``register`` callback, by plugin name.

        Plugins that do not implement ``hook`` are left out.
        """
        found = {name: self._registered_by(hook, name) for name in self._info}
        return {name: items for name, items in found.items() if items}

    def _registered_by(self, hook: str, name: str) -> list[Any]:
        """What plugin ``name`` registers through ``hook``; an error it raises gets a note naming it."""
        plugin = self._pm.get_plugin(name)
        if not hasattr(self._pm.hook, hook):
            return []
        others = [p for p in self._pm.get_plugins() if p is not plugin]
        items: list[Any] = []
        try:
            self._pm.subset_hook_caller(hook, remove_plugins=others)(register=items.append)
        except Exception as exc:
            exc.add_note(f"raised by {hook} of refit plugin {name!r}")
            raise
        return items

    # -- introspection ------------------------------------------------------------------------

    def has_plugin(self, name: str) -> bool:
        """Whether a plugin is registered under ``name``."""
        return self._pm.has_plugin(name=name)

    @property
    def plugins(self) -> list[PluginInfo]:
        return list(self._info.values())

    def backends(self, side: str | None = None) -> list[Backend]:
        found = [b for info in self._info.values() for b in info.backends]
        return [b for b in found if side is None or side in b.sides]

    def backend(self, name: str, side: str) -> Backend:
        for backend in self.backends(side):
            if backend.name == name:
                return backend
        known = ", ".join(b.name for b in self.backends(side)) or "none"
        raise PluginError(f"no installed plugin provides a {side} backend named {name!r} "
                          f"(installed {side} backends: {known}){self._env_hint()}")

    def _installed(self) -> str:
        names = [f"{i.name} ({i.distribution})" for i in self._info.values()]
        names += [f"{name} (failed to import: {error})" for name, error in self.broken.items()]
        return ", ".join(names) or "none"

    def _env_hint(self) -> str:
        wanted = read(PLUGINS_ENV)
        return f"; {PLUGINS_ENV}={wanted!r} restricts which plugins load" if wanted is not None else ""

    def _unrecognized(self, what: str, model: Any) -> PluginError:
        return PluginError(f"no installed refit plugin recognizes {what} of type "
                           f"{type(model).__module__}.{type(model).__qualname__} "
                           f"(installed plugins: {self._installed()}){self._env_hint()}")

    # -- hook calls ---------------------------------------------------------------------------

    @property
    def hook(self) -> Any:
        return self._pm.hook

    def source_pieces(self, model: Any) -> list[SourcePiece]:
        pieces = self.hook.refit_source_pieces(model=model)
        if pieces is None:
            raise self._unrecognized("the training model", model)
        return list(pieces)

    def destination_map(self, model: Any) -> DestinationMap:
        mapping = self.hook.refit_destination_map(model=model)
        if mapping is None:
            raise self._unrecognized("the generation model", model)
        return mapping

    def source_layout(self, backend: str, config: dict, layout: ParallelLayout, rank: int) -> list[SourcePiece]:
        pieces = self.hook.refit_source_layout(backend=backend, config=config, layout=layout, rank=rank)
        if pieces is None:
            raise PluginError(f"no installed plugin describes train backend {backend!r} from metadata "
                              f"(installed plugins: {self._installed()})")
        return list(pieces)

    def destination_layout(self, backend: str, config: dict, layout: ParallelLayout, rank: int) -> DestinationMap:
        mapping = self.hook.refit_destination_layout(backend=backend, config=config, layout=layout, rank=rank)
        if mapping is None:
            raise PluginError(f"no installed plugin describes gen backend {backend!r} from metadata "
                              f"(installed plugins: {self._installed()})")
        return mapping

    def adapter_destination_layout(self, backend: str, config: dict, layout: ParallelLayout, rank: int,
                                   lora: LoraSpec) -> DestinationMap | None:
        """The engine's own adapter map of ``rank`` (adapter mode), or None where refit derives it from the
        base layout (no plugin answers for ``backend``)."""
        return self.hook.refit_adapter_destination_layout(backend=backend, config=config, layout=layout,
                                                          rank=rank, lora=lora)

    def expert_name(self, hf_name: str) -> ExpertName | None:
        """``hf_name`` split into its expert group and index, or None if it is no per-expert name."""
        try:
            return self._expert_names[hf_name]
        except KeyError:
            pass
        if len(self._expert_names) >= EXPERT_NAMES_KEPT:
            self._expert_names.clear()
        found = self._expert_names[hf_name] = self.hook.refit_expert_name(hf_name=hf_name)
        return found

    def expert_member_name(self, group: str, index: int) -> str | None:
        """The per-expert checkpoint name of expert ``index`` of ``group``, or None if no plugin knows it.

        Raises :class:`PluginError` when the plugins' two naming hooks disagree.
        """
        name = self.hook.refit_expert_member_name(group=group, index=index)
        if name is not None and self.expert_name(name) != ExpertName(group, index):
            raise PluginError(f"refit_expert_member_name({group!r}, {index}) returned {name!r}, but "
                              f"refit_expert_name maps that to {self.expert_name(name)}: the two hooks must "
                              "be inverses of each other")
        return name

    def expert_naming(self) -> ExpertNaming:
        """Both directions of expert naming, through this manager's hooks."""
        return ExpertNaming(self.expert_name, self.expert_member_name)

    def model_tensors(self, model: Any) -> list[tuple[str, torch.Tensor]] | None:
        """``refit_model_tensors``: the named tensors ``model``'s pieces view (None: no plugin lists them)."""
        tensors = self.hook.refit_model_tensors(model=model)
        return None if tensors is None else list(tensors)

    def begin_update(self, model: Any) -> bool:
        return bool(self.hook.refit_begin_update(model=model))

    def load_weights(self, model: Any, weights: list) -> None:
        if self.hook.refit_load_weights(model=model, weights=weights) is None:
            raise self._unrecognized("(for the loader path) the generation model", model)

    def finish_update(self, model: Any, version: int) -> None:
        self.hook.refit_finish_update(model=model, version=version)

    def abort_update(self, model: Any, torn: list[str]) -> bool | None:
        """The plugin's answer: True handled, False could not restore, None not handled."""
        result = self.hook.refit_abort_update(model=model, torn=torn)
        return None if result is None else bool(result)


_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loading installed plugins on first use."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
    return _manager

