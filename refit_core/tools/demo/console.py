"""The per-step console of ``refit demo --loop``: table rows above a progress bar on a terminal, and
plain rows only (no bar redraws) when the output is a log file or a pipe."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class StepConsole:
    """Prints one row per step, and on a terminal a progress bar under the rows.

    ``bar_stream``: where the bar is drawn (default ``sys.stderr``); the bar is drawn only when it is a
    terminal (``isatty()``), since each redraw off a terminal would be written out as text.
    ``rows``: where the rows go (default ``sys.stdout``).
    """

    def __init__(self, steps: int, *, desc: str = "refit loop", bar_stream: TextIO | None = None,
                 rows: TextIO | None = None) -> None:
        self.rows = rows if rows is not None else sys.stdout
        stream = bar_stream if bar_stream is not None else sys.stderr
        self.bar: Any = None
        if _is_terminal(stream):
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=desc, unit="step", file=stream, dynamic_ncols=True)

    @property
    def drawing(self) -> bool:
        """True while a bar is drawn (the output is a terminal)."""
        return self.bar is not None

    def row(self, line: str, **status: str) -> None:
        """One finished step: ``line`` above the bar; ``status`` (e.g. ``reward="0.25"``) beside the bar."""
        if self.bar is None:
            print(line, file=self.rows, flush=True)
            return
        self.bar.write(line, file=self.rows)
        self.bar.set_postfix(status, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


__all__ = ["StepConsole"]
