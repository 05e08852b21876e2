"""Recovery is a tested path (issue 44): after each fault class, a peer killed, a peer stopped, the store's
host (train rank 0) stopped, the store's host killed, the job sets up again as a user would (new endpoints on
the same port, a replacement process for the rank that is gone) and refits bitwise; and a second setup that
meets a stopped store host still holding the port says so, where it said "another program is listening"."""

import os
import signal

import pytest
from campaign import GEN, TRAIN, Action, Point, Run, Strike, census_of
from census import COUNTS
from test_store_stopped_host import _until_stopped, store_host

from refit_core.contract.errors import RendezvousError
from refit_core.kit.launch import free_port
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous

FAULTS = {  # fault class: the strike, inside the second step's transfer
    "peer killed": Strike(TRAIN + 1, Point.TRANSFER, Action.KILL, 2),
    "peer stopped": Strike(1, Point.TRANSFER, Action.STOP, 2),
    "store host stopped": Strike(0, Point.TRANSFER, Action.STOP, 2),
    "store host killed": Strike(0, Point.TRANSFER, Action.KILL, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_after_each_fault_class_the_job_sets_up_again_and_refits_bitwise(mode):
    runs = [Run(i, mode, (strike,), timeout_s=2.0) for i, strike in enumerate(FAULTS.values())]
    census = census_of(runs, workers=len(runs))
    assert census.void == 0 and not census.problems, census.summary()
    assert not any(census.counts[k] for k in COUNTS), census.summary()
    assert census.recoveries == len(runs), census.summary()
    assert TRAIN + GEN == 4


def test_a_second_setup_against_a_stopped_store_host_says_what_holds_the_port():
    address = f"127.0.0.1:{free_port()}"
    with store_host(address) as host:
        os.kill(host.pid, signal.SIGSTOP)
        _until_stopped(host.pid)
        credentials = JobCredentials.of(None, "s")
        with pytest.raises(RendezvousError, match="did not answer .* stopped or hung .*SIGSTOP"):
            Rendezvous(address, host=False, who="gen/0", timeout_s=10, handshake_s=1, credentials=credentials)
        with pytest.raises(RendezvousError, match="could not host .* stopped or hung .*SIGSTOP"):
            Rendezvous(address, host=True, who="train/0", timeout_s=10, credentials=credentials)
