"""The machinery of refit's settings dataclasses: coercion, explicit fields, wire form, rebuilding.

:class:`_Settings` is what :class:`~refit_core.contract.options.RefitOptions` and its nested settings
(:class:`~refit_core.contract.options.MessageOptions`, a transport's own options...) share. A field's
``metadata["kind"]`` says how a given value is coerced: a settings class (from a dict), a ``StrEnum`` (from
its value), ``bool`` / ``int`` / ``float`` (checked), a class with a ``coerce_setting(where, value)``
classmethod, or a plain function ``(where, value) -> value``; a field without one takes its value as given.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, field, fields
from enum import StrEnum
from typing import Any, TypeVar

from refit_core.contract.errors import OptionError

_T = TypeVar("_T")


def _tracks_explicit(cls: type[_T]) -> type[_T]:
    """Record which constructor arguments were given (not None) as ``explicit`` field names."""
    generated = cls.__init__
    names = [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        generated(self, *args, **kwargs)
        given = {**dict(zip(names, args)), **kwargs}
        object.__setattr__(self, "_explicit", frozenset(n for n, v in given.items() if v is not None))

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


class _Settings:
    """Shared machinery of the settings dataclasses: coercion, explicit fields, wire form."""

    _explicit: frozenset[str] = frozenset()
    """The fields given explicitly (set by :func:`_tracks_explicit`; none for a class without it)."""

    def _coerce(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind = f.metadata.get("kind")
            if value is None:
                if f.default is None:
                    continue
                default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[operator]
                object.__setattr__(self, f.name, default)
                continue
            object.__setattr__(self, f.name, _coerced(type(self).__name__, f.name, kind, value))

    @property
    def explicit(self) -> frozenset[str]:
        """Dotted names of the settings given explicitly (``"nccl.comms_per_link"``)."""
        out = set()
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _Settings):
                out |= {f"{f.name}.{inner}" for inner in value.explicit}
            elif f.name in self._explicit:
                out.add(f.name)
        return frozenset(out)

    def to_wire(self, *, secrets: bool = False) -> dict[str, Any]:
        """A plain JSON-able dict of every field (enums as their values, nested settings and values with a
        ``to_wire()`` of their own as what it returns).

        Secret fields (``RefitOptions.secret``) are left out unless ``secrets``: pass True only to
        hand options to a process of the same job over a trusted channel, never to publish them. So is an
        empty field marked ``omit_empty`` (a field added later: the wire form of every setting before it
        stays the same).
        """
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if (f.metadata.get("secret") and not secrets) or (f.metadata.get("omit_empty") and not value):
                continue
            if isinstance(value, _Settings) or hasattr(value, "to_wire"):
                out[f.name] = value.to_wire()
            elif isinstance(value, StrEnum):
                out[f.name] = value.value
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, data: Any) -> Any:
        """Parse :meth:`to_wire`'s dict; an unknown key or a bad value raises :class:`OptionError`."""
        if not isinstance(data, dict):
            raise OptionError(f"{cls.__name__}: expected a dict of settings, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise OptionError(f"{cls.__name__}: unknown setting(s) {unknown} (known: {sorted(known)})")
        return cls(**data)

    def leaves(self, prefix: str = "") -> dict[str, Any]:
        """Every setting by dotted name, nested settings flattened."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _Settings):
                out.update(value.leaves(f"{prefix}{f.name}."))
            else:
                out[f"{prefix}{f.name}"] = value
        return out


def _coerced(owner: str, name: str, kind: Any, value: Any) -> Any:
    where = f"{owner}.{name}"
    if isinstance(kind, type) and issubclass(kind, _Settings):
        if isinstance(value, kind):
            return value
        return kind.from_wire(value)
    if hasattr(kind, "coerce_setting"):
        return kind.coerce_setting(where, value)
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in kind)
            raise OptionError(f"{where}={value!r}: use one of {choices}") from None
    if kind is bool:
        if not isinstance(value, bool):
            raise OptionError(f"{where}={value!r}: expected True or False")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise OptionError(f"{where}={value!r}: expected an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise OptionError(f"{where}={value!r}: expected a positive number")
        return float(value)
    if callable(kind) and not isinstance(kind, type):
        return kind(where, value)
    return value


def _setting(default: Any, kind: Any, *, local: bool = False) -> Any:
    return field(default=default, metadata={"kind": kind, "local": local})


def _nested(kind: type) -> Any:
    return field(default_factory=kind, metadata={"kind": kind, "local": False})


def _shown(value: Any) -> str:
    return repr(value.value) if isinstance(value, StrEnum) else repr(value)


def _rebuild(obj: _Settings, top: dict[str, Any], nested: dict[str, dict[str, Any]], explicit: bool) -> Any:
    """``obj`` with ``top`` values and ``nested`` changes; explicit fields stay explicit, and the
    changed ones become explicit when ``explicit``."""
    kwargs: dict[str, Any] = {}
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.name in nested:
            value = _rebuild(value, nested[f.name], {}, explicit)
        kwargs[f.name] = top.get(f.name, value)
    result = type(obj)(**kwargs)
    given = obj._explicit | (set(top) if explicit else set())
    object.__setattr__(result, "_explicit", frozenset(n for n in given if kwargs.get(n) is not None))
    return result


__all__ = ["_Settings", "_coerced", "_nested", "_rebuild", "_setting", "_shown", "_tracks_explicit"]
