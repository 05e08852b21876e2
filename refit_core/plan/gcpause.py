"""Pausing Python's cyclic garbage collector while planning builds millions of small objects."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off (restored after, if it was on).

    Planning at scale allocates a million boxes, transfers and segments, none of them in a cycle;
    each generation-2 collection would walk all of them again, which cost planning 3-4x its time.
    Reference counting still frees everything as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
