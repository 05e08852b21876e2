"""Trainer-side ``VLLMWeightSyncClient``s for an engine in this process.

vLLM ships HTTP and Ray clients; these drive an ``LLM`` or ``AsyncLLM`` object directly, and also
reset the prefix cache after each update (cached KV was computed with the old weights).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class LLMClient:
    """Drives an offline ``vllm.LLM``."""

    def __init__(self, llm: Any, *, reset_prefix_cache: bool = True) -> None:
        self.llm = llm
        self.reset = reset_prefix_cache

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)
        if self.reset:
            self.llm.reset_prefix_cache()


class AsyncLLMClient:
    """Drives a ``vllm.v1.engine.async_llm.AsyncLLM`` running on ``loop`` (from another thread).

    Pausing is the caller's: ``pause_generation(mode="keep")`` before ``send_weights`` keeps requests
    in flight, which then continue on the new weights after ``resume_generation()``.
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, reset_prefix_cache: bool = True) -> None:
        self.engine = engine
        self.loop = loop
        self.reset = reset_prefix_cache

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version=weight_version))
        if self.reset:
            self._run(self.engine.reset_prefix_cache())
