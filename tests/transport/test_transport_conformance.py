"""The transport conformance check (``refit_core.testing.check_transport``) on real processes: refit's gloo
and the example plugin's TCP transport pass it on CPU, NCCL on two GPUs, and a transport that breaks the
contract fails it, naming each broken check."""

from __future__ import annotations

import pytest
import torch

from tests.environments import BY_DESIGN

from refit_core.testing.results import ConformanceError, Outcome
from refit_core.testing.transport import check_transport

CHECKS = {"opens", "register", "exchanges land bitwise", "after fences", "control exchange", "broadcasts land bitwise",
          "non-contiguous refused", "abort reaches peers", "close is idempotent"}


@pytest.mark.parametrize("name", ["gloo", "toy-tcp"])
def test_cpu_transports_pass_every_check_across_three_ranks(name):
    results = check_transport(name, world_size=3, timeout_s=10)
    assert {r.name.removeprefix(f"{name}: ") for r in results} == CHECKS
    assert all(r.outcome is Outcome.PASSED for r in results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason=f"{BY_DESIGN}needs 2 CUDA GPUs")
def test_nccl_passes_every_check_on_two_gpus():
    results = check_transport("nccl", world_size=2, device="cuda", timeout_s=30)
    assert all(r.outcome is Outcome.PASSED for r in results)


def test_a_transport_that_ignores_fences_and_contiguity_fails_those_checks_by_name():
    with pytest.raises(ConformanceError) as failed:
        check_transport("toy-tcp-careless", world_size=2, timeout_s=10, source="broken_transports:CARELESS")
    failures = {r.name for r in failed.value.results if r.outcome is Outcome.FAILED}
    assert failures == {"toy-tcp-careless: after fences", "toy-tcp-careless: non-contiguous refused"}
    assert "sent its tensor before the fence" in str(failed.value)


def test_an_unknown_transport_fails_the_check_naming_the_installed_ones():
    with pytest.raises(ConformanceError, match="no transport named 'no-such' is installed .*gloo.*nccl"):
        check_transport("no-such")
