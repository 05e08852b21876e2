"""Starting several ranks of one program on this machine (demo, tests): spawn, wait, fail loudly."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, nprocs: int, args: tuple, env: dict[str, str],
           outcomes: Any) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs)})
    try:
        result = fn(rank, nprocs, *args)
    except BaseException:  # noqa: BLE001 - report every failure (SystemExit too) to the parent, then exit
        outcomes.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)
    outcomes.put((rank, True, result))


class RankFailure(RuntimeError):
    """One or more spawned ranks failed; the message holds their tracebacks."""


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, env: dict[str, str] | None = None,
          timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` fresh processes; return their results by rank.

    If any rank fails or the timeout passes, the others are killed and :class:`RankFailure` is
    raised with each failing rank's traceback (never a hang). ``fn`` must be importable (top level).
    """
    ctx = mp.get_context("spawn")
    outcomes = ctx.SimpleQueue()
    procs = [ctx.Process(target=_entry, args=(fn, r, nprocs, args, dict(env or {}), outcomes), daemon=False)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    results: dict[int, Any] = {}
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # let a failing rank's peers report their own errors
    finally:
        timed_out = any(p.is_alive() for p in procs)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        while not outcomes.empty():
            rank, ok, payload = outcomes.get()
            if ok:
                results[rank] = payload
            else:
                failed.append(f"--- rank {rank} ---\n{payload}")
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if timed_out and not failed:
        raise RankFailure(f"ranks {bad} did not finish within {timeout_s:.0f} s")
    if bad:
        raise RankFailure(f"ranks {bad} of {fn.__name__} failed:\n" + "\n".join(failed))
    return [results.get(r) for r in range(nprocs)]
