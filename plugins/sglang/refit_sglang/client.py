"""The trainer's side of an SGLang refit: SGLang's own update protocol around refit's transfer.

One trainer process (usually train rank 0) holds the engine handle and runs, per step::

    [pause_generation]            HTTP only (SGLang's offline Engine has no pause in 0.5.23)
    begin_weight_update           SGLang restores packed weights on every TP worker
    update_weights_from_tensor    load_format=refit_sglang.worker.receive: every TP worker runs
        (ticket for version v)    one refit step, while the train ranks call sender.send(v)
                                  (flush_cache, and weight_version over HTTP, as SGLang applies them)
    end_weight_update             SGLang re-applies post-load processing (kernel layouts)
    [continue_generation]

The ``update_weights_from_tensor`` call blocks until the workers have received, so this client runs
``send`` (this rank's ``RefitSender.send``) in a helper thread alongside it. Other train ranks call
``sender.send(version)`` themselves. See the plugin README for the same calls written out beside
``update_weights_from_distributed``.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from refit_core import RefitError

from .ticket import LOAD_FORMAT, RefitTicket

T = TypeVar("T")

log = logging.getLogger("refit.sglang")


class PauseMode(enum.Enum):
    """SGLang's ``pause_generation`` modes: abort in-flight requests, retract them to the waiting
    queue (their KV cache is recomputed after the update), or keep them in place."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


class _Sender(Generic[T]):
    """``send()`` in a helper thread; ``result()`` re-raises its exception in the caller."""

    def __init__(self, send: Callable[[], T]) -> None:
        self._send = send
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="refit-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._send()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _check(what: str, answer: Any) -> None:
    """SGLang's session calls answer ``(success, message)`` (Engine) or ``{"success", "message"}``."""
    if isinstance(answer, dict):
        ok, message = answer.get("success", True), answer.get("message", "")
    elif isinstance(answer, (tuple, list)) and len(answer) >= 2:
        ok, message = answer[0], answer[1]
    else:
        ok, message = True, ""
    if not ok:
        raise RefitError(f"SGLang {what} failed: {message}")


class _Protocol:
    def _call(self, what: str, **payload: Any) -> Any:
        raise NotImplementedError

    def _pause(self, mode: PauseMode) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def update(self, ticket: RefitTicket, send: Callable[[], T], *, pause: PauseMode | None = None) -> T:
        """Run one refit step into the engine: SGLang's session around ``send()``; returns its result.

        ``send`` is this rank's ``lambda: sender.send(ticket.version)`` (on the first step of a
        session, ``sender.setup()`` first: the workers set up inside that step's call). On any failure the session
        is still closed (so the next step can open one) and the first error is raised.
        """
        if pause is not None:
            self._pause(pause)
        try:
            _check("begin_weight_update", self._call("begin_weight_update"))
            sender: _Sender[T] | None = None
            try:
                sender = _Sender(send)
                _check("update_weights_from_tensor", self._call(
                    "update_weights_from_tensor", ticket=ticket, load_format=LOAD_FORMAT,
                    flush_cache=True, weight_version=str(ticket.version)))
                result = sender.result()
            except BaseException:
                if sender is not None:
                    try:
                        sender.result()
                    except BaseException as exc:  # noqa: BLE001 - the engine's error is the one to raise
                        log.warning("refit: this rank's send failed too: %s", exc)
                self._call("end_weight_update")
                raise
            _check("end_weight_update", self._call("end_weight_update"))
            return result
        finally:
            if pause is not None:
                self._resume()


class EngineClient(_Protocol):
    """Refit steps into an offline ``sglang.Engine`` (in the trainer's process).

    The engine must be created with ``custom_weight_loader=["refit_sglang.worker.receive"]``.
    ``update_weights_from_tensor`` is sent as ``Engine.update_weights_from_tensor`` sends it (the
    request to its tokenizer manager), with the ticket pre-serialized and ``weight_version`` set,
    which sglang 0.5.23's ``Engine`` method does not take.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def _call(self, what: str, **payload: Any) -> Any:
        if what != "update_weights_from_tensor":
            return getattr(self.engine, what)()
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        ticket: RefitTicket = payload.pop("ticket")
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[ticket.serialized()] * self.engine.server_args.tp_size, **payload)
        return self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weights_from_tensor(request, None))

    def _pause(self, mode: PauseMode) -> None:
        raise RefitError("SGLang's offline Engine cannot pause generation (sglang 0.5.23: HTTP server only); "
                         "refit between generate() calls instead")

    def _resume(self) -> None:
        pass


class HttpClient(_Protocol):
    """Refit steps into an SGLang HTTP server at ``base_url`` (``http://host:30000``).

    The server must be launched with ``--custom-weight-loader refit_sglang.worker.receive``;
    ``tp_size`` is its tensor-parallel size (one serialized ticket per TP worker, as SGLang expects).
    Only the ticket travels in the request; the weights go through refit's own transport.
    """

    def __init__(self, base_url: str, *, tp_size: int, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.tp_size = tp_size
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.base_url}/{route}", data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise RefitError(f"SGLang {route} answered HTTP {exc.code}: {detail}") from None
        return json.loads(text) if text.strip() else {}

    def _call(self, what: str, **payload: Any) -> Any:
        if what == "update_weights_from_tensor":
            ticket: RefitTicket = payload.pop("ticket")
            encoded = base64.b64encode(ticket.serialized()).decode()
            payload["serialized_named_tensors"] = [encoded] * self.tp_size
        return self._post(what, payload)

    def _pause(self, mode: PauseMode) -> None:
        self._post("pause_generation", {"mode": mode.value})

    def _resume(self) -> None:
        self._post("continue_generation", {})
