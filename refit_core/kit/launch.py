"""Starting several ranks of one program on this machine (demo, tests): spawn, wait, fail loudly."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for
from typing import Any

from refit_core.contract.env import with_overrides
from refit_core.contract.options import RefitOptions
from refit_core.net.auth import new_secret
from refit_core.net.ports import free_port as free_port  # its home before refit 0.3: callers import it here

PRELOADED = ("torch", "refit_core")
"""What the server that forks the ranks imports once (a rank then starts in a fraction of a second, not the
seconds ``import torch`` takes in a fresh interpreter)."""


def _context() -> Any:
    """Ranks fork from multiprocessing's fork server: a fresh single-threaded process of this program that
    imported :data:`PRELOADED` (safe to fork, unlike the caller, which may run threads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def _entry(fn: Callable[..., Any], rank: int, nprocs: int, args: tuple, environ: dict[str, str],
           outcomes: Any, stacks_after_s: float) -> None:
    faulthandler.enable()  # a crash prints every thread's Python stack
    faulthandler.dump_traceback_later(stacks_after_s)  # so does a hang, just before the parent kills it
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(environ)
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
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` new processes; return their results by rank.

    Each rank runs with this process's environment as it is now, plus ``env``; the ranks are one refit job:
    without ``REFIT_SECRET`` there (and ``REFIT_INSECURE``), they share a fresh random one
    (:func:`~refit_core.net.auth.new_secret`). If any rank fails or
    the timeout passes, the others are killed and :class:`RankFailure` is raised with each failing rank's
    traceback (never a hang). ``fn`` must be importable (top level).
    """
    ctx = _context()
    outcomes = ctx.SimpleQueue()
    stacks_after_s = max(1.0, timeout_s - 2.0)
    environ = _with_secret({**os.environ, **(env or {})})
    procs = [ctx.Process(target=_entry, args=(fn, r, nprocs, args, environ, outcomes, stacks_after_s),
                         daemon=False)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    results: dict[int, Any] = {}
    try:
        running = {p.sentinel: p for p in procs}
        while running and time.monotonic() < deadline:  # wakes as soon as a rank exits
            for ready in wait_for(list(running), timeout=max(0.0, deadline - time.monotonic())):
                assert isinstance(ready, int)  # a process sentinel
                running.pop(ready).join()  # it has exited: reaping it sets its exit code
            if any(p.exitcode not in (None, 0) for p in procs):
                break
        if running:
            time.sleep(0.2)  # a rank failed or the deadline passed: let the others report their own errors
    finally:
        still_running = {r for r, p in enumerate(procs) if p.is_alive()}
        deadline_passed = time.monotonic() > deadline
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
    if bad and not failed:
        exits = ", ".join(f"rank {r}: {_exit_status(procs[r].exitcode, killed_by_us=r in still_running)}"
                          for r in bad)
        raise RankFailure((f"ranks {bad} did not finish within {timeout_s:.0f} s" if deadline_passed
                           else f"ranks {bad} of {fn.__name__} did not end cleanly") + f" ({exits})")
    if bad:
        raise RankFailure(f"ranks {bad} of {fn.__name__} failed:\n" + "\n".join(failed))
    return [results.get(r) for r in range(nprocs)]


def _with_secret(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with a fresh ``REFIT_SECRET`` where it gives no secret and does not opt out (``REFIT_INSECURE``)."""
    given = with_overrides(RefitOptions(), environ)
    if given.secret or given.insecure:
        return environ
    return {**environ, "REFIT_SECRET": new_secret()}


def _exit_status(code: int | None, killed_by_us: bool) -> str:
    if killed_by_us:
        return "killed by the launcher"
    if code is not None and code < 0:
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"exit code {code}"
