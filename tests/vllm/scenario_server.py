"""A fork server for ``scenarios.py``: one process imports vLLM, torch and the plugins once, then forks a
fresh child per scenario (its own session, its output in files), so that no scenario pays those imports
(seconds each on CI's two cores) and none sees another's engine, workers or vLLM process state.

``python scenarios.py --serve`` runs :func:`serve`; :class:`ScenarioServer` is the tests' side.
Requests and replies are JSON lines on the server's stdin and stdout: ``{"name", "kwargs", "stdout",
"stderr"}`` in, ``{"pid"}`` once the child runs, then ``{"pid", "exit"}`` when it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

PRELOAD = ("vllm", "vllm.config", "vllm.v1.engine.async_llm", "vllm.engine.arg_utils", "transformers",
           "refit_vllm.demo", "refit_vllm.extension", "refit_vllm.reference", "refit_vllm.transfer",
           "refit_vllm.clients", "refit_vllm.layout", "refit_dtensor", "refit_core.kit.launch")
"""Modules every scenario imports: the server imports them before it forks (none starts a thread)."""


def serve(run: Callable[[str, dict[str, Any]], None]) -> None:
    """Fork a child per request line on stdin that runs ``run(name, kwargs)`` (which must not return);
    report its pid, then its exit status. Ends when stdin closes (the tests' process is gone)."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDONLY)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            reply.close()
            os.dup2(null, 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                target = os.open(path, os.O_WRONLY | os.O_TRUNC)
                os.dup2(target, fd)
                os.close(target)
            try:
                run(request["name"], request["kwargs"])
            finally:
                os._exit(1)
        reply.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}) + "\n")


@dataclass(frozen=True)
class Finished:
    """What one scenario's process left: its output and exit status (None: killed at its deadline)."""

    stdout: str
    stderr: str
    exit: int | None


class ScenarioServer:
    """The tests' side of :func:`serve`: started on first use, one scenario at a time."""

    def __init__(self, script: Path) -> None:
        self.script = script
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending = b""

    def _server(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(self.script), "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
            self.pending = b""
        return self.proc

    def run(self, name: str, kwargs: dict[str, Any], timeout: float, out: IO[str], err: IO[str]) -> Finished:
        """Run scenario ``name`` in a fresh child, its stdout and stderr into the named files ``out``
        and ``err``; whatever it leaves behind (engine, workers, trainers) is killed."""
        server = self._server()
        assert server.stdin is not None
        server.stdin.write(json.dumps({"name": name, "kwargs": kwargs, "stdout": out.name,
                                       "stderr": err.name}).encode() + b"\n")
        deadline = time.monotonic() + timeout
        pid = self._reply(deadline)["pid"]
        try:
            done = self._reply(deadline)
        except TimeoutError:
            done = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if done is None:  # the child is dead now: its exit line follows at once
            self._reply(time.monotonic() + 60)
        out.seek(0)
        err.seek(0)
        return Finished(out.read(), err.read(), None if done is None else done["exit"])

    def _reply(self, deadline: float) -> dict[str, Any]:
        """The server's next reply line, read unbuffered so that ``select`` sees every line still unread."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError("the scenario did not finish in time")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the scenario server exited ({self._server_exit()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def _server_exit(self) -> int | None:
        assert self.proc is not None
        return self.proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the server (its stdin closes; it exits after the scenario it runs, if any)."""
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None
