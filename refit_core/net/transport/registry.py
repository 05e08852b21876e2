"""The transport registry: transport kinds by name, from the entry-point group ``refit.transports``.

In the style of vLLM's ``WeightTransferEngineFactory``: a name maps to an entry point (``"module:attr"``,
a :class:`~refit_core.net.transport.kind.TransportType`), imported the first time that name is used, so a
refit on gloo never imports NCCL's bindings, and ``net`` never imports the layers above it (the colocated
``ipc`` kind lives in ``refit_core.run.ipc``). refit-core registers its own kinds (``gloo``, ``nccl``,
``ipc``) in its ``pyproject.toml`` exactly as a third party does; :func:`register_transport` adds one in
this process (tests, notebooks).

A name nobody registered is an :class:`~refit_core.contract.errors.OptionError` naming the installed
ones. Every rank resolves the agreed name itself when it opens the transport, before any collective, so
an unknown name fails setup on every rank with the same message.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading

import torch
import torch.distributed as dist

from refit_core.contract.errors import OptionError
from refit_core.contract.options import TransportKind
from refit_core.contract.transport_options import TransportOptions, set_options_finder
from refit_core.net.transport.base import Transport
from refit_core.net.transport.kind import TransportContext, TransportType
from refit_core.net.transport.watch import PeerWatch

ENTRY_POINT_GROUP = "refit.transports"

BUILT_IN = {
    "gloo": "refit_core.net.transport.gloo:GLOO",
    "nccl": "refit_core.net.transport.nccl:NCCL",
    "ipc": "refit_core.run.ipc:IPC",
}
"""refit-core's own entry points (its ``pyproject.toml``), used only where the installed metadata lacks
them: a source checkout installed before the table existed must still find gloo and NCCL."""

log = logging.getLogger("refit")

_lock = threading.RLock()  # an entry point may register another kind while it imports
_registered: dict[str, TransportType] = {}
_sources: dict[str, str] | None = None  # name -> "module:attr", read once from the installed metadata


def _entry_points() -> dict[str, str]:
    global _sources
    if _sources is None:
        found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        _sources = {**BUILT_IN, **found}
    return _sources


def register_transport(kind: TransportType, *, replace: bool = False) -> None:
    """Register ``kind`` in this process, under its name (an installed kind of that name included only
    when ``replace``); :class:`OptionError` for a name taken."""
    if not isinstance(kind, TransportType):
        raise OptionError(f"register_transport: expected a TransportType, got {type(kind).__name__}")
    with _lock:
        if not replace and (kind.name in _registered or kind.name in _entry_points()):
            raise OptionError(f"a transport named {kind.name!r} is registered already (replace=True overrides it)")
        _registered[kind.name] = kind


def unregister_transport(name: str) -> None:
    """Forget what :func:`register_transport` registered as ``name`` (an installed kind comes back)."""
    with _lock:
        _registered.pop(name, None)


def transport_names() -> list[str]:
    """Every registered transport name (installed and registered in this process), sorted."""
    return sorted({*_entry_points(), *_registered})


def transport_type(name: str) -> TransportType:
    """The transport kind registered as ``name``, imported on first use.

    Raises :class:`OptionError` naming the registered transports when none is, and naming the entry point
    when it does not import or is no :class:`TransportType` of that name.
    """
    with _lock:
        found = _registered.get(name)
        if found is not None:
            return found
        source = _entry_points().get(name)
        if source is None:
            raise OptionError(f"no transport named {name!r} is installed (installed: "
                              f"{', '.join(sorted({*_entry_points(), *_registered}))}; a third-party transport "
                              f"registers under the entry-point group {ENTRY_POINT_GROUP!r})")
        module, _, attr = source.partition(":")
        try:
            loaded = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # any import failure of a plugin is reported, named
            raise OptionError(f"transport {name!r} ({source}) failed to import: {type(exc).__name__}: {exc}") from exc
        if not isinstance(loaded, TransportType) or loaded.name != name:
            raise OptionError(f"transport entry point {name!r} ({source}) is not a TransportType named {name!r}")
        _registered[name] = loaded
        return loaded


def _options_class(kind: str) -> type[TransportOptions] | None:
    """The contract's finder (:func:`~refit_core.contract.transport_options.set_options_finder`)."""
    try:
        return transport_type(kind).options
    except OptionError:
        return None


set_options_finder(_options_class)


def resolve_kind(kind: str, device: torch.device) -> str:
    """``auto`` becomes NCCL for a rank on CUDA, gloo otherwise; any other name stays as it is."""
    if kind == TransportKind.AUTO:
        return TransportKind.NCCL if device.type == "cuda" else TransportKind.GLOO
    return kind


def network_type(name: str) -> TransportType:
    """The network transport kind ``name`` (resolved already: not ``auto``); :class:`OptionError` when it is
    unknown or no network transport."""
    kind = transport_type(name)
    if not kind.network:
        raise OptionError(f"transport {name!r} is no network transport ({kind.summary or 'it opens no exchange'}); "
                          f"network transports: {', '.join(n for n in transport_names() if _is_network(n))}")
    return kind


def _is_network(name: str) -> bool:
    try:
        return transport_type(name).network
    except OptionError:
        return False


def options_of(kind: TransportType, given: TransportOptions | None) -> TransportOptions | None:
    """The options ``kind`` opens with: ``given``, or its options class's defaults (None: it has none)."""
    if kind.options is None:
        if given is not None:
            raise OptionError(f"transport {kind.name!r} takes no options, but {type(given).__name__} was given")
        return None
    if given is None:
        return kind.options()
    if not isinstance(given, kind.options):
        raise OptionError(f"transport {kind.name!r} takes {kind.options.__name__}, not {type(given).__name__}")
    return given


def open_transport(kind: str, store: dist.Store, rank: int, world_size: int, device: torch.device,
                   timeout_s: float, options: TransportOptions | None = None, *, watch: PeerWatch | None = None,
                   rendezvous: str | None = None) -> Transport:
    """Open the transport ``kind`` (``auto`` resolved for ``device``) from the refit's store; collective over
    all ranks of the refit once the name resolved (an unknown name raises on this rank before any collective).

    ``options``: the kind's options (None: its defaults); ``watch`` (None: none) tells a slow wait that a peer
    is gone or gave up (:mod:`refit_core.net.transport.watch`); ``rendezvous`` is the refit's ``host:port``
    (None: unknown), whose interface a listening transport binds to.
    """
    chosen = network_type(resolve_kind(kind, device))
    context = TransportContext(store, rank, world_size, device, timeout_s, options_of(chosen, options), watch,
                               rendezvous)
    assert chosen.open is not None  # network_type checked
    return chosen.open(context)


__all__ = ["BUILT_IN", "ENTRY_POINT_GROUP", "network_type", "open_transport", "options_of", "register_transport",
           "resolve_kind", "transport_names", "transport_type", "unregister_transport"]
