"""Setup-time coordination through a TCPStore: metadata exchange, agreement checks, error broadcast.

Train rank 0 hosts the store at the rendezvous address; everyone else connects as a client. A rank
that fails during setup writes its error under ``error`` so the others stop at once with that
message instead of waiting for metadata that will never come.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import PlanError, RefitError

POLL_S = 0.02


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RefitError(f"rendezvous {address!r}: expected HOST:PORT")
    return host or "127.0.0.1", int(port)


class Rendezvous:
    """A namespace in a TCPStore shared by every train and gen rank of one refit."""

    def __init__(self, address: str, *, host: bool, timeout_s: float, namespace: str = "refit") -> None:
        hostname, port = parse_address(address)
        self.timeout_s = timeout_s
        try:
            tcp = dist.TCPStore(hostname, port, is_master=host, timeout=timedelta(seconds=timeout_s),
                                wait_for_workers=False, use_libuv=True)
        except Exception as exc:  # re-raised with the address
            role = "host" if host else "reach"
            raise RefitError(f"could not {role} the refit rendezvous at {address}: {exc}") from exc
        self.store = dist.PrefixStore(namespace + "/", tcp)
        self._tcp = tcp

    def publish(self, key: str, value: Any) -> None:
        self.store.set(key, pickle.dumps(value))

    def read(self, key: str, default: Any = None) -> Any:
        """The value under ``key`` now, or ``default``; never waits, never raises."""
        try:
            return pickle.loads(self.store.get(key)) if self.store.check([key]) else default
        except Exception:  # noqa: BLE001
            return default

    def fail(self, error: Exception, where: str, done_key: str) -> None:
        """Tell every other rank that setup failed, and why; then mark this rank as done."""
        try:
            if not self.store.check(["error"]):  # the first error is the cause; keep it
                self.publish("error", (type(error).__name__, f"{where}: {error}"))
            self.store.set(done_key, b"")
        except Exception:  # noqa: BLE001 - best effort: the store's host may have exited already
            pass

    def linger(self, keys: list[str], timeout_s: float) -> None:
        """Keep the store up until ``keys`` exist or ``timeout_s`` passes (the host, after a failure,
        so that every rank can still read the error instead of losing the store)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return
            except Exception:  # noqa: BLE001 - a slow client must not make the host leave early
                pass
            time.sleep(POLL_S)

    def _check_error(self) -> None:
        if self.store.check(["error"]):
            kind, message = pickle.loads(self.store.get("error"))
            cls = PlanError if kind == PlanError.__name__ else RefitError  # a bad plan is a bad plan everywhere
            raise cls(f"refit setup failed on another rank: {message}")

    def wait(self, keys: list[str], what: str) -> list[Any]:
        """Values of ``keys`` once all exist; raises on timeout or on another rank's error."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while not self.store.check(keys):
                self._check_error()
                if time.monotonic() > deadline:
                    missing = [k for k in keys if not self.store.check([k])]
                    raise RefitError(f"timed out after {self.timeout_s:.0f} s waiting for {what}: "
                                     f"missing {', '.join(missing[:8])}")
                time.sleep(POLL_S)
            self._check_error()
            return [pickle.loads(self.store.get(k)) for k in keys]
        except dist.DistError as exc:
            raise RefitError(f"lost the refit rendezvous while waiting for {what} (the train side's "
                             f"rank 0 hosts it and has probably exited): {exc}") from exc
