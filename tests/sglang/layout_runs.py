"""A test module's multi-process refits, run once per layout and shared by every test of that layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def once_per_layout(launch: Callable[[str], Any]) -> Callable[[str], Any]:
    """``launch(layout)``, memoized; a failure is kept too and raised to every test of that layout."""
    done: dict[str, Any] = {}

    def run(layout: str) -> Any:
        if layout not in done:
            try:
                done[layout] = launch(layout)
            except Exception as exc:  # noqa: BLE001 - every test of the layout reports it
                done[layout] = exc
        if isinstance(done[layout], Exception):
            raise done[layout]
        return done[layout]
    return run
