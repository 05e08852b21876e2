"""An engine that refuses ``init_weight_transfer_engine`` tells the trainers why, through refit's setup.

refit's setup broadcasts a failure inside ``RefitReceiver.setup()`` to every rank of both sides at
once (the rendezvous' error record). A worker that fails *before* its setup (init info vLLM cannot
parse, a gen rank outside the refit's world size, a model it cannot attach) would otherwise leave the
trainers waiting for it until their deadline, with only a timeout to show. :func:`publish` runs a
setup whose only plugin fails with the worker's error, so the trainers raise with its text.

The trainer side does the same when train rank 0's client call itself raises (an engine started
without ``weight_transfer_config``, an HTTP error, a dead Ray actor: no refit code ran in the engine):
:func:`publish_client_error` speaks for the engine, so every train rank fails at once with its error.
"""

from __future__ import annotations

import logging
from typing import Any

from refit_core import PluginManager, RefitError, RefitOptions, RefitReceiver, hookimpl

from .state import worker_rank

log = logging.getLogger("refit.vllm")

PUBLISH_S = 5.0
"""The longest a refusing worker tries to reach the rendezvous (the trainers host it as they set up)."""


class EngineSetupError(RefitError):
    """A vLLM worker refused to join a refit session before its setup started."""


class _Refuses:
    """A plugin whose destination map is the worker's error: setup fails with it."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    @hookimpl
    def refit_destination_map(self, model: Any) -> None:
        raise self.error


def engine_error(error: Exception) -> EngineSetupError:
    """The error the trainers see for ``error`` (its type and text, and where it happened)."""
    return EngineSetupError(f"the vLLM engine refused init_weight_transfer_engine: {type(error).__name__}: {error}")


def client_error(error: Exception) -> EngineSetupError:
    """The error the trainers see when train rank 0's client call ``init_weight_transfer_engine`` raised
    ``error`` (its type and text)."""
    return EngineSetupError(f"the vLLM engine's init_weight_transfer_engine raised (train rank 0's client): "
                            f"{type(error).__name__}: {error}")


def publish_client_error(error: Exception, *, rendezvous: str, options: dict[str, Any] | None = None) -> None:
    """Tell every rank of the refit at ``rendezvous`` that train rank 0's client call failed with ``error``,
    speaking as gen rank 0 of one: the store's host then waits for that rank alone before it leaves, so
    every train rank fails within a second, whatever its ``timeout_s``. If the engine's gen rank 0 is still
    connected (the engine joined, the client failed anyway), the store refuses this second gen rank 0
    and the setup fails naming the double join; the engine's error is then a note on train rank 0's."""
    publish(client_error(error), rendezvous=rendezvous, rank=0, world_size=1, options=options)


def publish(error: EngineSetupError, *, rendezvous: str, rank: int, world_size: int,
            options: dict[str, Any] | None = None) -> None:
    """Tell every rank of the refit at ``rendezvous`` that this worker failed with ``error``, as gen rank
    ``rank`` (clamped into ``world_size``). Best effort, within :data:`PUBLISH_S`: a rendezvous this
    worker cannot join, or where that rank already joined, hears nothing (the trainers see their own
    timeout, and the engine's error reaches the trainer rank whose client called it as a note)."""
    plugins = PluginManager(load_entry_points=False)
    plugins.register(_Refuses(error), name="refit-vllm-refusal")
    world_size = max(int(world_size), 1)
    wishes = dict(options or {})
    try:
        deadline = min(float(wishes.get("timeout_s") or PUBLISH_S), PUBLISH_S)
        settings = RefitOptions(**{**wishes, "timeout_s": deadline})
    except Exception:  # noqa: BLE001 - the options may be what was refused: job, secret and a deadline suffice
        settings = RefitOptions(job=wishes.get("job"), secret=wishes.get("secret"), timeout_s=PUBLISH_S)
    receiver = RefitReceiver(None, rendezvous=rendezvous, rank=min(max(rank, 0), world_size - 1),
                             world_size=world_size, options=settings, plugins=plugins)
    try:
        receiver.setup()
    except Exception as exc:  # noqa: BLE001 - the expected outcome is our own error; anything else is logged
        if exc is not error:
            log.warning("refit: could not tell the trainers at %s why this engine refused (%s: %s)",
                        rendezvous, type(exc).__name__, exc)
    finally:
        receiver.close()


def refuse_before_setup(error: Exception, parallel_config: Any, rendezvous: str, world_size: Any,
                        rank_offset: Any, options: Any) -> None:
    """Publish ``error`` to the refit at ``rendezvous`` as the gen rank of this worker (of
    ``parallel_config``), from init info that may itself be malformed (wrong types are ignored)."""
    try:
        rank, workers = worker_rank(parallel_config)
    except RefitError:  # a config refit cannot read (what may be refused): speak as the first gen rank
        rank, workers = 0, 1
    offset = rank_offset if isinstance(rank_offset, int) else 0
    world = world_size if isinstance(world_size, int) and world_size > 0 else workers
    publish(engine_error(error), rendezvous=rendezvous, rank=offset + rank, world_size=world,
            options=options if isinstance(options, dict) else None)
