"""The weight version rules of ``send(version)``: in range, and greater than the last one sent, unless reset.

A version travels as a signed 64-bit word in every step's header, so it must lie in
``[0, MAX_VERSION]``. Each successful step's version must be greater than the last one this sender sent
(kept across ``close()`` and ``setup()``); ``send(version, reset=True)`` starts a new sequence at any
version in range (a trainer restored from a checkpoint). A refused version fails the step on every rank,
naming the cause, before any byte moves.
"""

from __future__ import annotations

import operator
from typing import Any

MAX_VERSION = 2**63 - 1
"""The largest weight version (the header's word is a signed 64-bit integer)."""


def checked_version(version: Any, last: int | None, reset: bool) -> int | str:
    """``version`` as an int if a step may send it after ``last`` (None: none sent yet), else why not."""
    try:
        value = operator.index(version) if not isinstance(version, bool) else None
    except TypeError:
        value = None
    if value is None:
        return f"weight version {version!r} is not an integer"
    if not 0 <= value <= MAX_VERSION:
        return f"weight version {value} is out of range: a version is an integer from 0 to 2**63 - 1"
    if not reset and last is not None and value <= last:
        return (f"weight version {value} is not greater than the last version sent, {last}: versions increase "
                "from step to step (send(version, reset=True) starts a new sequence, e.g. after restoring a "
                "checkpoint)")
    return value


__all__ = ["MAX_VERSION", "checked_version"]
