"""A transport kind's own settings: the base class its options derive from, and the per-kind field.

A transport kind owns its options (:class:`TransportOptions`): NCCL's are
:class:`~refit_core.contract.nccl_options.NcclOptions`, which keep their own field
``RefitOptions.nccl``; any other kind's travel in ``RefitOptions.transport_options`` (a
:class:`PerTransportOptions`, one options object per kind). Both sides must agree on them like on every
other setting: they are part of the published settings and, once given, of the plan's fingerprint.

The contract cannot import the transports (they sit above it), so an options class is found by its
``kind``: a class registers itself when it is defined, and the transport registry
(:mod:`refit_core.net.transport.registry`) installs a finder that loads the transport of that name, so that
options published as a dict can be read back on a rank that has not imported that transport yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from refit_core.contract.errors import OptionError
from refit_core.contract.settings import _Settings

_classes: dict[str, type[TransportOptions]] = {}
_finder: Callable[[str], type[TransportOptions] | None] | None = None


class TransportOptions(_Settings):
    """Base of one transport kind's settings: subclass it as a frozen dataclass with a ``kind``.

    Fields hold plain JSON values (numbers, strings, booleans) with defaults; validate them in
    ``__post_init__`` (call ``super().__post_init__()`` first) and raise
    :class:`~refit_core.contract.errors.OptionError` naming the class and the field::

        @dataclass(frozen=True)
        class TcpOptions(TransportOptions):
            kind: ClassVar[str] = "toy-tcp"
            chunk_bytes: int = 1 << 20
    """

    kind: ClassVar[str] = ""
    """The transport name these options belong to (as registered)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            _classes.setdefault(cls.kind, cls)

    def __post_init__(self) -> None:
        self._coerce()


def set_options_finder(finder: Callable[[str], type[TransportOptions] | None]) -> None:
    """Install how an options class is found by kind when no class of that kind was defined yet (the
    transport registry does, on import); ``finder`` returns None for a kind without options."""
    global _finder
    _finder = finder


def options_class(kind: str) -> type[TransportOptions]:
    """The options class of transport ``kind``; :class:`OptionError` when none is known."""
    found = _classes.get(kind)
    if found is None and _finder is not None:
        found = _finder(kind)
    if found is None:
        raise OptionError(f"RefitOptions.transport_options: no installed transport named {kind!r} has options")
    return found


@dataclass(frozen=True)
class PerTransportOptions:
    """The options of transport kinds other than NCCL, one object per kind (``RefitOptions.transport_options``).

    Given as a mapping ``{kind: options or dict}`` or a sequence of options objects; empty by default.
    A kind with no entry runs with its options class's defaults.
    """

    entries: tuple[TransportOptions, ...] = ()
    """Sorted by kind, one per kind."""

    @classmethod
    def coerce_setting(cls, where: str, value: Any) -> PerTransportOptions:
        """``value`` as per-kind options (see the class doc); :class:`OptionError` naming ``where``."""
        if isinstance(value, PerTransportOptions):
            return value
        items: Iterable[tuple[str, Any]]
        if isinstance(value, Mapping):
            items = value.items()
        elif isinstance(value, TransportOptions):
            items = [(value.kind, value)]
        elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
            items = [(getattr(v, "kind", "?"), v) for v in value]
        else:
            raise OptionError(f"{where}={value!r}: expected {{transport name: options}}")
        found: dict[str, TransportOptions] = {}
        for kind, options in items:
            if kind == "nccl":
                raise OptionError(f"{where}: NCCL's options are RefitOptions.nccl (NcclOptions)")
            if not isinstance(options, TransportOptions):
                options = options_class(kind).from_wire(options)
            if options.kind != kind:
                raise OptionError(f"{where}: options of {options.kind!r} ({type(options).__name__}) given for {kind!r}")
            if kind in found:
                raise OptionError(f"{where}: two options objects for {kind!r}")
            found[kind] = options
        return cls(tuple(found[k] for k in sorted(found)))

    def get(self, kind: str) -> TransportOptions | None:
        """The options given for ``kind``, or None (its defaults apply)."""
        return next((o for o in self.entries if o.kind == kind), None)

    def to_wire(self) -> dict[str, Any]:
        """``{kind: options as a dict}``."""
        return {o.kind: o.to_wire() for o in self.entries}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __repr__(self) -> str:
        return f"PerTransportOptions({self.to_wire()!r})"


__all__ = ["PerTransportOptions", "TransportOptions", "options_class", "set_options_finder"]
