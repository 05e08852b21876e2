"""Setup-time coordination: metadata exchange, agreement checks and error broadcast over refit's store.

Train rank 0 hosts the store (:class:`~refit_core.net.store.StoreServer`) at the rendezvous address,
bound to that address's interface only; every rank, the host included, joins it as an authenticated
client (:class:`~refit_core.net.store.StoreClient`). Values are JSON (:mod:`refit_core.net.wire`), never
pickle. A rank that fails during setup writes its error under ``error``; every other rank's waits
(and gloo's or NCCL's rendezvous on the same store) stop at once with that message, and a rank whose
connection closes (it died) stops them too, naming it, instead of letting them wait for their deadline.
A wait holds a missing key's read open on the store (a quarter second at a time) rather than polling,
and :meth:`Rendezvous.barrier` costs each rank O(1) requests whatever the world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from refit_core.contract.errors import AuthenticationError, PlanError, PluginError, RefitError, RendezvousError
from refit_core.contract.options import StoreLimits
from refit_core.net import wire
from refit_core.net.auth import JobCredentials, warn_without_secret
from refit_core.net.keys import barrier_keys, publisher, rank_name
from refit_core.net.store import ERROR_KEY, WAIT_SLICE_S, Endpoint, StoreClient, StoreServer

POLL_S = 0.02
HANDSHAKE_S = 5.0
_KINDS = {cls.__name__: cls for cls in (PlanError, PluginError, RendezvousError, AuthenticationError)}


@dataclass(frozen=True)
class Abandoned:
    """Ranks that will never come to a job's store (store identities: they died before they came), and why the
    job cannot go on: a failure to raise, and ranks no one waits for."""

    ranks: frozenset[str]
    reason: str


class Rendezvous:
    """One setup's store: hosted here when ``host``, joined always as rank ``who`` (the store identity of a
    :class:`~refit_core.net.keys.RankId`, ``"train/0"``); its keys are :mod:`refit_core.net.keys`.
    ``limits`` bound what the store accepts (the host's only; None: :class:`StoreLimits` defaults); ``guests``:
    the host admits a fleet's joining replicas and observers too (:mod:`refit_core.fleet`); ``hosted_by``: who
    hosts the store, as errors name it.
    Without a secret in ``credentials`` it logs a warning, once per process."""

    def __init__(self, address: str, *, host: bool, who: str, timeout_s: float,
                 credentials: JobCredentials | None = None, handshake_s: float = HANDSHAKE_S,
                 limits: StoreLimits | None = None, guests: bool = False, hosted_by: str = "train rank 0") -> None:
        endpoint = Endpoint.parse(address)
        credentials = credentials or JobCredentials()
        warn_without_secret(credentials, str(endpoint))
        self.timeout_s = timeout_s
        self.server = (StoreServer(endpoint, credentials, handshake_s=handshake_s, limits=limits, guests=guests)
                       if host else None)
        try:
            self.client = StoreClient(endpoint, credentials, who, timeout_s=timeout_s, handshake_s=handshake_s,
                                      host=hosted_by)
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        self.client.watch = self._check_failures
        self.store = self.client
        self.abandoned: Callable[[], Abandoned | None] | None = None
        """Asked whenever this rank looks for failures: ranks expected here that died before they came, and why
        the job cannot go on (None while it can; see :mod:`refit_core.fleet`)."""
        self.downloaded = 0
        """Bytes of values this rank read through :meth:`read` and :meth:`wait` (setup's metadata)."""

    # -- values -------------------------------------------------------------------------------

    def publish(self, key: str, value: Any, within: float | None = None) -> None:
        """Write ``value`` (JSON) under ``key``; ``within``: what is left of the caller's deadline, which
        bounds how long a stopped host may keep this rank waiting (None: ``min(timeout_s, 30 s)``)."""
        self.client.set(key, wire.encode(value), within)

    def offer(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` unless the key holds a value already (best effort: never raises)."""
        try:
            self.client.compare_set(key, b"", wire.encode(value))
        except RefitError:
            pass

    def read(self, key: str, default: Any = None) -> Any:
        """The value under ``key`` now, or ``default``; never waits, never raises."""
        try:
            raw = self.client.try_get(key)
            if raw is None:
                return default
            self.downloaded += len(raw)
            return wire.decode(raw, key)
        except RefitError:
            return default

    def wait(self, keys: list[str], what: str, *, timeout_s: float | None = None,
             watched: Collection[str] | None = None) -> list[Any]:
        """Values of ``keys`` once all exist; raises on timeout (``timeout_s``, None: the rendezvous'),
        on a failed setup's error or on the departure of a rank in ``watched`` (store identities;
        None: any rank)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        values: dict[str, Any] = {}

        def still_missing() -> str:
            missing = [rank_name(k) for k in keys if k not in values]
            return f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} did not arrive"

        def waiting() -> str:
            return f"; this rank was still waiting for {what}: {still_missing()}"

        while True:
            blocked = False  # the store held the first missing key's read open: no need to sleep
            for key in keys:
                if key not in values:
                    raw = self.client.try_get(key, wait_s=0.0 if blocked else WAIT_SLICE_S,
                                              within=deadline - time.monotonic())
                    blocked = blocked or raw is None
                    if raw is not None:
                        self.downloaded += len(raw)
                        values[key] = wire.decode(raw, f"{what} ({key})")
            if len(values) == len(keys):  # every value arrived: no need to look for failures
                return [values[k] for k in keys]
            self._check_failures(deadline - time.monotonic(), watched, waiting)
            if time.monotonic() > deadline:
                waited = self.timeout_s if timeout_s is None else timeout_s
                raise RefitError(f"timed out after {waited:.0f} s waiting for {what}: {still_missing()}")
            if not blocked:
                time.sleep(POLL_S)

    def barrier(self, name: str, count: int, arrived: list[str], what: str) -> None:
        """Return once ``count`` ranks called ``barrier(name, ...)``: O(1) requests per rank (a counter,
        then one key the last arrival sets). ``arrived`` are the keys the ranks published before
        arriving; on timeout the error names the ranks whose key is missing."""
        deadline = time.monotonic() + self.timeout_s
        keys = barrier_keys(name)
        if self.client.add(keys.count, 1) >= count:
            self.client.set(keys.all, b"1")
        while self.client.try_get(keys.all, wait_s=WAIT_SLICE_S, within=deadline - time.monotonic()) is None:
            self._check_failures(deadline - time.monotonic())
            if time.monotonic() > deadline:
                missing = [rank_name(k) for k in arrived if not self.client.check([k])]
                raise RefitError(f"timed out after {self.timeout_s:.0f} s waiting for {what}: "
                                 f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} did not arrive")
        self._check_failures()

    # -- failures -----------------------------------------------------------------------------

    def fail(self, error: Exception, where: str, done_key: str) -> None:
        """Tell every other rank that setup failed, and why; then mark this rank as done."""
        record = wire.encode({"kind": type(error).__name__, "message": f"{where}: {error}"})
        try:
            self.client.compare_set(ERROR_KEY, b"", record)  # the first error is the cause; keep it
            self.client.set(done_key, b"1")
        except RefitError:  # best effort: the store's host may have exited already
            pass

    def _check_failures(self, within: float | None = None, watched: Collection[str] | None = None,
                        waiting: Callable[[], str] | None = None) -> None:
        """Raise another rank's error, or name the ranks in ``watched`` (store identities; None: any) that
        left; ``within``: what is left of the caller's deadline (bounds how long the host may take to answer).
        ``waiting`` says what this rank itself still waited for, appended to another rank's error: that
        rank may have given up first on what this one already knew was missing (a rank that never came)."""
        raw = self.client.try_get(ERROR_KEY, within=within)
        if raw is not None:
            record = wire.decode(raw, "another rank's error")
            kind = record.get("kind") if isinstance(record, dict) else None
            message = record.get("message") if isinstance(record, dict) else None
            cls = _KINDS.get(kind, RefitError)  # a bad plan is a bad plan everywhere
            raise cls(f"refit setup failed on another rank: {str(message)[:4000]}{waiting() if waiting else ''}")
        gone = [who for who in self.client.gone(within) if watched is None or who in watched]
        if gone:
            raise RendezvousError(f"{', '.join(map(rank_name, gone))} left the refit "
                                  "(its connection to the rendezvous closed: it exited or was killed)")
        abandoned = self._abandoned_now()
        if abandoned is not None:
            raise RendezvousError(abandoned.reason)

    def _abandoned_now(self) -> Abandoned | None:
        return self.abandoned() if self.abandoned is not None else None

    def linger(self, keys: list[str], timeout_s: float) -> None:
        """Keep the store up until ``keys`` exist (or their ranks are gone) or ``timeout_s`` passes:
        the host, after a failure, so that every rank can still read the error."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                abandoned = self._abandoned_now()
                gone = set(self.client.gone()) | (abandoned.ranks if abandoned is not None else frozenset())
                pending = [k for k in keys if (who := publisher(k)) is None or str(who) not in gone]
                if not pending or self.client.check(pending):
                    return
            except RefitError:  # a slow client must not make the host leave early
                pass
            time.sleep(POLL_S)

    # -- lifetime -----------------------------------------------------------------------------

    def seal(self) -> None:
        """Setup finished: the host admits no further ranks into this store."""
        if self.server is not None:
            self.server.seal()

    def close(self) -> None:
        """Leave (saying goodbye) and, on the host, stop the store: the port is free for a new setup."""
        self.client.close(goodbye=True)
        if self.server is not None:
            self.server.close()
