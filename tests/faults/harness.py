"""Starting rank processes that may be killed or stopped on purpose, and collecting what survivors say.

``refit_core.kit.launch.spawn`` kills every rank as soon as one fails, which is right for a demo and
wrong here: a fault test kills or stops a rank deliberately and then watches what the others do.
Each rank puts ``(rank, event, payload)`` on a queue: ``"failed"`` as soon as a step failed (so the
test can start a replacement), ``"result"`` at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

ENV = {"REFIT_PLUGINS": "toy"}  # importing every installed plugin costs seconds per process


def _entry(fn: Callable[..., Any], rank: int, events: Any, go: Any, environ: dict[str, str], args: tuple) -> None:
    os.environ.clear()  # the test's environment when it started the rank, not the fork server's
    os.environ.update(environ)
    os.environ.update(ENV)
    import refit_toy.plugin  # noqa: F401

    import refit_core.endpoints.base  # noqa: F401 - the slow imports happen before the start line

    events.put((rank, "ready", None))
    go.wait()
    try:
        result = fn(rank, lambda event, payload=None: events.put((rank, event, payload)), *args)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        events.put((rank, "crash", traceback.format_exc()))
        raise SystemExit(1)
    events.put((rank, "result", result))


class Ranks:
    """A set of rank processes and the events they report."""

    def __init__(self) -> None:
        """Rank processes fork from multiprocessing's fork server, which imported torch and refit once (a
        fraction of a second each instead of seconds; the server is the one ``refit_core.kit.spawn`` uses,
        whichever of them starts it first sets what it imports)."""
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "refit_core.endpoints", "refit_toy.plugin", "harness"])
        self.events = self._ctx.Queue()
        self.go = self._ctx.Event()  # ranks start their programs together, once all have imported
        self.procs: dict[int, mp.Process] = {}
        self.seen: dict[tuple[int, str], Any] = {}

    def start(self, fn: Callable[..., Any], rank: int, *args: Any, env: dict[str, str] | None = None) -> None:
        """Start ``fn(rank, report, *args)`` in a rank process, in this process's environment with ``env`` over it."""
        proc = self._ctx.Process(target=_entry, args=(fn, rank, self.events, self.go, {**os.environ, **(env or {})},
                                                      args), daemon=True)
        proc.start()
        self.procs[rank] = proc

    def release(self, timeout_s: float = 180) -> None:
        """Let every rank started so far run, once all have imported (later ones run at once)."""
        self.wait_for([(rank, "ready") for rank in self.procs], timeout_s)
        self.go.set()

    def wait_for(self, wanted: list[tuple[int, str]], timeout_s: float) -> dict[tuple[int, str], Any]:
        """Wait until every ``(rank, event)`` in ``wanted`` arrived; raise naming what did not."""
        deadline = time.monotonic() + timeout_s
        while not all(w in self.seen for w in wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [w for w in wanted if w not in self.seen]
                raise AssertionError(f"no {missing} within {timeout_s:.0f} s; got {self.seen}")
            try:
                rank, event, payload = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if event == "crash":
                raise AssertionError(f"rank {rank} crashed:\n{payload}")
            self.seen[(rank, event)] = payload
        return {w: self.seen[w] for w in wanted}

    def kill(self, rank: int) -> None:
        proc = self.procs[rank]
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited since is_alive()
                pass
        proc.join(timeout=10)

    def close(self) -> None:
        for rank in list(self.procs):
            self.kill(rank)
