"""A worker extension for ``collective_rpc`` users: ``LLM(..., worker_extension_cls=EXTENSION)``.

    llm = LLM(model, worker_extension_cls="refit_vllm.extension.RefitWorkerExtension")
    llm.collective_rpc("refit_init", args=("127.0.0.1:29600",))   # with the trainers' setup
    llm.collective_rpc("refit_receive")                           # each step, with their send
    llm.reset_prefix_cache()

or, as one replica of a fleet (``refit_core.apps.RefitFleet`` on the trainers), joining the running job:

    llm.collective_rpc("refit_join_fleet", args=("127.0.0.1:29600", "replica-3"))

The same receiver as the ``refit`` weight-transfer backend, without vLLM's weight-transfer config.
"""

from __future__ import annotations

from typing import Any

from refit_core import LoraSpec, RefitError, RefitOptions, RefitReceiver, get_plugin_manager
from refit_core.apps import join_fleet

from .checkpoint import step_catalog
from .lora import AdapterTarget, adapter_versions, lora_spec
from .refusal import refuse_before_setup
from .serving import own_state, refused
from .state import attach, ensure_attached, state_of, worker_rank

EXTENSION = "refit_vllm.extension.RefitWorkerExtension"


class RefitWorkerExtension:
    """Mixed into every vLLM worker; methods run through ``collective_rpc``."""

    def _refit_model(self) -> Any:
        model = self.model_runner.get_model()
        ensure_attached(model, self.vllm_config)
        return model

    def refit_init(self, rendezvous: str, world_size: int | None = None, rank_offset: int = 0,
                   options: dict[str, Any] | None = None, loader: list[str] | None = None,
                   lora: LoraSpec | dict[str, Any] | str | None = None) -> int:
        """Join the refit at ``rendezvous`` as gen rank ``rank_offset`` + this worker's rank; returns it.
        ``lora``: adapter mode (:mod:`refit_vllm.lora`): the session moves this adapter into the engine's
        LoRA slots (registered once per name); None: the model's weights."""
        self.refit_close()
        try:
            rank, workers = worker_rank(self.vllm_config.parallel_config)
            model = self._refit_model()
            attach(model, self.vllm_config, loader=loader or ())
            target = model if lora is None else AdapterTarget(model, lora_spec(lora))
            receiver = RefitReceiver(target, rendezvous=rendezvous, rank=rank_offset + rank,
                                     world_size=world_size or workers, options=RefitOptions(**(options or {})))
        except Exception as exc:  # before setup: the trainers would only see their deadline pass
            refuse_before_setup(exc, self.vllm_config.parallel_config, rendezvous, world_size, rank_offset, options)
            raise
        receiver.setup()
        self._refit_receiver = receiver
        return rank_offset + rank

    def refit_join_fleet(self, fleet: str, replica: str, options: dict[str, Any] | None = None,
                         loader: list[str] | None = None, join_timeout_s: float = 600.0) -> int:
        """Join this engine, as replica ``replica`` (its workers its ranks), to the running fleet whose store is at
        ``fleet`` (:func:`refit_core.apps.join_fleet`); returns this worker's rank. ``refit_receive`` then receives
        the step that admitted it, whole. After a failed step, join again."""
        self.refit_close()
        rank, workers = worker_rank(self.vllm_config.parallel_config)
        model = self._refit_model()
        attach(model, self.vllm_config, loader=loader or ())
        self._refit_receiver = join_fleet(model, fleet=fleet, replica=replica, rank=rank, world_size=workers,
                                          options=RefitOptions(**(options or {})), join_timeout_s=join_timeout_s)
        return rank

    def refit_receive(self, version: int | None = None, only: list[str] | None = None) -> int | None:
        """Receive one step (the engine keeps its previous weights where it can if it fails); returns
        the version this worker holds. ``only``: the HF tensors of a subset step (the trainers'
        ``send(only=...)``; None: all). A failed step, or an engine that refuses to serve after it, is
        raised by the last worker only (:class:`refit_vllm.serving.StepOutcome`)."""
        from .worker_transfer import receive_step, refuse_step, step_subset  # imports vLLM: in the worker only

        receiver = getattr(self, "_refit_receiver", None)
        if receiver is None:
            raise RefitError("call refit_init before refit_receive")
        model = self._refit_model()
        names = None
        if only is not None:
            try:
                names = step_subset(model, step_catalog(self.vllm_config.model_config), None, only)
            except Exception as exc:  # the trainers are in the step already: fail it on every rank
                refuse_step(receiver, model, exc)
                raise
        version, self._refit_stats = receive_step(receiver, model, version, names)
        return version

    def refit_weight_version(self) -> int | None:
        """The last weight version refit landed in this worker (None before the first)."""
        state = state_of(self._refit_model())
        return None if state is None else state.version

    def refit_adapter_versions(self) -> dict[str, int | None]:
        """Each refit adapter in this worker's LoRA slots and the version it holds (:mod:`refit_vllm.lora`)."""
        return adapter_versions(self._refit_model())

    def refit_rank_state(self) -> tuple[int, int | None, int]:
        """This worker's (gen rank, weight version it holds, why it needs a refit: 0 when it does not,
        else a :class:`refit_vllm.serving.Suspect`), either route; see
        :class:`refit_vllm.serving.RankState` (the rank is the worker's index before any session)."""
        model = self._refit_model()
        engine = getattr(self, "weight_transfer_engine", None)
        receiver = getattr(self, "_refit_receiver", None) or getattr(engine, "receiver", None)
        state = own_state(receiver, model, worker_rank(self.vllm_config.parallel_config)[0],
                          state_of(model).version)
        return state.rank, state.version, int(state.suspect or 0)

    def refit_refusal(self) -> str | None:
        """Why this worker's model refuses to serve (:mod:`refit_vllm.serving`), or None when it serves."""
        return refused(self._refit_model())

    def refit_destination_metas(self) -> list[tuple[str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]]:
        """This worker's destination map as plain data: (name, shape, dtype, box offsets, box sizes)."""
        model = self._refit_model()
        mapping = get_plugin_manager().destination_map(model)
        rows = [(p.spec.name, p.spec.shape, str(p.spec.dtype), p.box.offsets, p.box.sizes) for p in mapping.pieces]
        rows += [(s.name, s.shape, str(s.dtype), (0,) * len(s.shape), s.shape) for s in mapping.loader]
        return rows

    def refit_step_stats(self) -> dict[str, Any]:
        """The last step's stats on this worker (version, bytes, seconds), either route."""
        engine = getattr(self, "weight_transfer_engine", None)
        stats = getattr(engine, "last_stats", None) or getattr(self, "_refit_stats", None)
        return dict(stats or {})

    def refit_close(self) -> None:
        receiver = getattr(self, "_refit_receiver", None)
        if receiver is not None:
            receiver.close()
        self._refit_receiver = None
