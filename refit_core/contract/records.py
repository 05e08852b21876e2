"""Frozen records built from fields already known good, skipping their constructors' checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")

_BUILDERS: dict[type, Callable[..., Any]] = {}


def unchecked(cls: type[R]) -> Callable[..., R]:
    """A builder of the dataclass ``cls`` that takes every field (``init=False`` ones too), by position in
    declaration order or by name, and stores them as given: no ``__init__``, no ``__post_init__``.

    It builds what the checked constructor would from the same values (``tests/core/test_records.py``),
    at the cost of a plain object: a frozen dataclass' constructor sets each field through
    ``object.__setattr__``, and planning at scale builds millions of boxes, segments and transfers from
    values already checked. The fields are filled in declaration order, so instances share their
    class' dict keys (half the memory of a dict of their own). Only for values that already passed the
    checks: a wrong value is stored as is.
    """
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _builder(cls)
    return build


def _builder(cls: type) -> Callable[..., Any]:
    params, body = [], []
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"unchecked({cls.__name__}): field {f.name} has a default factory")
        if f.default is not dataclasses.MISSING and f.init:
            defaults[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        else:
            params.append(f.name)
        body.append(f"    fields[{f.name!r}] = {f.name}\n")
    source = (f"def build({', '.join(params)}):\n    record = new(cls)\n    fields = record.__dict__\n"
              f"{''.join(body)}    return record\n")
    namespace: dict[str, Any] = {"new": object.__new__, "cls": cls, **defaults}
    exec(source, namespace)  # the dataclass' own field names only, as dataclasses itself does
    build: Callable[..., Any] = namespace["build"]
    build.__qualname__ = f"unchecked({cls.__qualname__})"
    return build
