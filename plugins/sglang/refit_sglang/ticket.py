"""The refit ticket: what a trainer hands every SGLang TP worker through SGLang's own update call.

SGLang's ``update_weights_from_tensor`` carries ``(name, tensor)`` pairs to a custom loader in every
TP worker. refit's moves no weights through it: the ticket travels as the *name* of one empty
tensor (an empty tensor pickles without shared memory, so the same payload works for the offline
``Engine`` and, base64-encoded, for the HTTP server). The name is JSON, parsed field by field into a
frozen dataclass; nothing of it is unpickled by refit.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from refit_core import RefitError, RefitOptions

TICKET_PREFIX = "refit.ticket:"

LOAD_FORMAT = "refit_sglang.worker.receive"
"""The custom loader SGLang runs for a ticket: pass it as ``load_format`` and allow it at launch with
``--custom-weight-loader refit_sglang.worker.receive`` (``custom_weight_loader=[...]`` for ``Engine``)."""


@dataclass(frozen=True)
class RefitTicket:
    """One refit step, as every TP worker of one SGLang engine receives it.

    - ``rendezvous``: ``host:port`` of the store train rank 0 hosts;
    - ``world_size``: generation ranks of the whole refit (every engine's TP workers together);
    - ``rank_offset``: this engine's first generation rank (its TP worker ``r`` is rank
      ``rank_offset + r``), as in SGLang's ``init_weights_update_group``;
    - ``version``: the weight version the trainer sends this step; the worker fails if another lands;
    - ``timeout_s``: the workers' deadline for setup and every step (train rank 0 decides every
      other :class:`RefitOptions` setting for both sides).
    """

    rendezvous: str
    world_size: int
    version: int
    rank_offset: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        host, sep, port = self.rendezvous.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise RefitError(f"RefitTicket.rendezvous: expected host:port, got {self.rendezvous!r}")
        if self.world_size < 1 or not 0 <= self.rank_offset < self.world_size:
            raise RefitError(f"RefitTicket: rank_offset {self.rank_offset} must lie in world_size "
                             f"{self.world_size}")
        if self.timeout_s <= 0:
            raise RefitError(f"RefitTicket.timeout_s must be positive, got {self.timeout_s}")

    @property
    def session(self) -> tuple[str, int, int]:
        """What identifies the receiver a worker keeps across steps (a new session sets up anew)."""
        return (self.rendezvous, self.world_size, self.rank_offset)

    def options(self) -> RefitOptions:
        return RefitOptions(timeout_s=self.timeout_s)

    def at(self, version: int) -> RefitTicket:
        """The same session's ticket for weight ``version``."""
        return replace(self, version=version)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The payload for ``update_weights_from_tensor``: one empty tensor named by the ticket."""
        return [(TICKET_PREFIX + json.dumps(asdict(self), sort_keys=True), torch.empty(0, dtype=torch.uint8))]

    def serialized(self) -> bytes:
        """:meth:`named_tensors` as SGLang's ``MultiprocessingSerializer`` writes them, one copy per TP
        worker goes in ``serialized_named_tensors``.

        Written with torch's own tensor reduction even where SGLang patched it for CUDA IPC
        (``monkey_patch_torch_reductions``, which cannot reduce CPU tensors): an empty CPU tensor
        pickles as ``rebuild_storage_empty``, which SGLang's ``SafeUnpickler`` accepts.
        """
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing import reductions

        buffer = io.BytesIO()
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = getattr(reductions, "_reduce_tensor_original",
                                                        reductions.reduce_tensor)
        pickler.dump(self.named_tensors())
        return buffer.getvalue()

    @classmethod
    def parse(cls, named_tensors: Any) -> RefitTicket:
        """The ticket in an ``update_weights_from_tensor`` payload; RefitError naming what is wrong."""
        items = list(named_tensors)
        if len(items) != 1 or not isinstance(items[0], (tuple, list)) or len(items[0]) != 2:
            raise RefitError(f"refit_sglang.worker.receive expects exactly one (name, tensor) pair, the ticket "
                             f"from RefitTicket.named_tensors(); got {len(items)} item(s)")
        name = items[0][0]
        if not isinstance(name, str) or not name.startswith(TICKET_PREFIX):
            raise RefitError(f"refit_sglang.worker.receive: {str(name)[:80]!r} is not a refit ticket")
        try:
            values = json.loads(name[len(TICKET_PREFIX):])
        except json.JSONDecodeError as exc:
            raise RefitError(f"refit ticket is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise RefitError("refit ticket must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise RefitError(f"refit ticket has unknown field(s) {unknown}")
        kinds = {"rendezvous": str, "world_size": int, "version": int, "rank_offset": int,
                 "timeout_s": (int, float)}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, kinds[key]):
                raise RefitError(f"refit ticket field {key}: {value!r} has the wrong type")
        missing = [k for k in ("rendezvous", "world_size", "version") if k not in values]
        if missing:
            raise RefitError(f"refit ticket lacks field(s) {missing}")
        return cls(**values)
