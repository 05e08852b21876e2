"""Safe by default (issue 44, findings 1 and 2): with the defaults no process without the job's secret
joins, and two jobs that meet on one port never exchange a byte of weights.

The race is made deterministic: job A's trainer hosts the rendezvous and waits; job A's engine is held
before its setup (a file gate) while job B's trainer and engine start on the same port; then A's engine
is let go. Each job sends its own weights (:data:`two_jobs_ranks.SEEDS`), so a byte of the other job
cannot pass for one's own."""

import threading
import time

import pytest
from harness import Ranks
from test_rendezvous_faults import _listening_address
from two_jobs_ranks import SEEDS, job_rank

from refit_core.contract.env import with_overrides
from refit_core.contract.errors import AuthenticationError
from refit_core.contract.options import RefitOptions
from refit_core.kit.launch import free_port
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous
from refit_core.tools.demo.runner import side_environment

A, B = SEEDS
WHAT_TO_SET = ("REFIT_SECRET=$(refit secret)", "RefitOptions(secret=...)", "RefitOptions(insecure=True)",
               "REFIT_INSECURE=1")


def _race(monkeypatch, gate, environments: dict[int, dict[str, str]], options: dict) -> dict[int, dict]:
    """Job A's train rank 0 (rank 0) waits on the port; A's engine (rank 1) is held at ``gate`` while job B's
    train rank 0 (10) and engine (11) start on the same port; then A's engine goes. ``environments``: each
    job's (seed's) refit variables, as its launcher gave them."""
    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()

    def start(rank: int, seed: int, train: bool, held: bool = False) -> None:
        for name in ("REFIT_SECRET", "REFIT_INSECURE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in environments[seed].items():
            monkeypatch.setenv(name, value)
        ranks.start(job_rank, rank, address, train, seed, options, str(gate) if held else None)

    try:
        start(0, A, train=True)
        start(1, A, train=False, held=True)
        ranks.release()
        b_first = _listening_or_refused(ranks, address)
        start(10, B, train=True)
        start(11, B, train=False)
        results = ranks.wait_for([(10, "result"), (11, "result")], timeout_s=120)
        gate.touch()
        results |= ranks.wait_for([(0, "result"), (1, "result")], timeout_s=120)
    finally:
        ranks.close()
    return {rank: result for (rank, _), result in results.items()} | {"a_listened": b_first}


def _listening_or_refused(ranks: Ranks, address: str) -> bool:
    """Wait until job A's train rank hosts the port (True) or has refused to set up at all (False)."""
    port = int(address.rpartition(":")[2])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            _listening_address(port)
            return True
        except AssertionError:
            pass
        try:
            ranks.wait_for([(0, "result")], timeout_s=0.1)
            return False
        except AssertionError:
            pass
    raise AssertionError("job A's train rank neither listened nor returned")


@pytest.mark.slow
def test_two_jobs_launched_with_their_own_secrets_never_mix_and_b_is_refused_by_name(monkeypatch, tmp_path):
    """Each job's launcher gave it its own secret (as ``refit demo`` does). B's trainer finds the port busy,
    B's engine is refused by A's store by name, and A, once its engine is let go, refits bitwise."""
    environments = {seed: {"REFIT_SECRET": side_environment({}, {})["REFIT_SECRET"]} for seed in SEEDS}
    r = _race(monkeypatch, tmp_path / "go", environments, {})
    assert r["a_listened"]
    host_b, engine_b = r[10], r[11]
    assert host_b["error"] == "RendezvousError" and "could not host" in host_b["message"], host_b
    assert "(a busy port: it holds another refit rendezvous (its store started at" in host_b["message"], host_b
    assert engine_b["error"] == "AuthenticationError", engine_b
    assert "is another refit job's (its store started at" in engine_b["message"], engine_b
    assert engine_b["untouched"] and engine_b["holds"] == [], engine_b  # not one byte of job A
    assert r[0].get("ok") and r[1].get("ok"), (r[0], r[1])
    assert r[1]["holds"] == [A] and r[1]["version"] == A, r[1]  # job A's own weights, bitwise, none of B's


@pytest.mark.slow
def test_two_jobs_with_the_defaults_and_no_launcher_refuse_to_set_up_naming_what_to_set(monkeypatch, tmp_path):
    """Finding 1: both jobs with the defaults (no secret, job name "refit") on one port exchanged weights.
    Now no rank sets up without a secret: each says what to set, and no engine holds a byte of anyone's."""
    r = _race(monkeypatch, tmp_path / "go", {A: {}, B: {}}, {})
    for rank in (0, 1, 10, 11):
        assert r[rank]["error"] == "AuthenticationError", r[rank]
        assert all(what in r[rank]["message"] for what in WHAT_TO_SET), r[rank]
    assert r[1]["untouched"] and r[11]["untouched"], (r[1], r[11])


@pytest.mark.slow
def test_the_insecure_opt_in_works_by_name_and_warns(monkeypatch, tmp_path):
    """Opting out by name (``insecure=True`` on the trainer, ``REFIT_INSECURE=1`` on the engine) refits as
    before, and every rank warns that it runs without a secret."""
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.delenv("REFIT_SECRET", raising=False)
    ranks = Ranks()
    try:
        ranks.start(job_rank, 0, address, True, A, {"insecure": True})
        monkeypatch.setenv("REFIT_INSECURE", "1")
        ranks.start(job_rank, 1, address, False, A, {})
        ranks.release()
        results = ranks.wait_for([(0, "result"), (1, "result")], timeout_s=120)
    finally:
        ranks.close()
    train, gen = results[(0, "result")], results[(1, "result")]
    assert train.get("ok") and gen.get("ok") and gen["holds"] == [A], (train, gen)
    for result in (train, gen):
        warned = [w for w in result["warnings"] if "without a secret (insecure=True)" in w]
        assert len(warned) == 1 and "REFIT_SECRET" in warned[0], result["warnings"]


def test_a_rank_without_a_secret_is_refused_before_it_opens_a_socket(monkeypatch):
    """Finding 2's default: no secret (none given, none in the environment, no launcher's) refuses setup
    at once, naming every way to set one, instead of opening a rendezvous anyone could join."""
    from refit_toy.models import ToyEngine

    from refit_core import RefitReceiver

    monkeypatch.delenv("REFIT_SECRET", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    port = free_port()
    receiver = RefitReceiver(ToyEngine(0, 1), rendezvous=f"127.0.0.1:{port}", rank=0, world_size=1,
                             options=RefitOptions(timeout_s=5))
    with pytest.raises(AuthenticationError) as refused:
        receiver.setup()
    assert str(refused.value).startswith("gen rank 0: refit refuses to set up without a secret"), refused.value
    assert all(what in str(refused.value) for what in WHAT_TO_SET), refused.value
    assert with_overrides(RefitOptions(), {"REFIT_INSECURE": "1"}).insecure


def test_outsiders_without_the_secret_are_refused_and_cannot_break_the_setup():
    """Finding 2's attack on a job with a secret: 50 made-up identities without it are refused before
    they read or write; none is admitted, so none of their departures counts as a rank that left."""
    port = free_port()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10,
                      credentials=JobCredentials("refit", b"the-job's"))
    try:
        host.publish("meta/train/0", [1])
        refusals = []

        def intrude(n: int) -> None:
            try:
                Rendezvous(f"127.0.0.1:{port}", host=False, who=f"gen/{n}", timeout_s=5, handshake_s=2,
                           credentials=JobCredentials())
            except AuthenticationError as exc:
                refusals.append(str(exc))
        threads = [threading.Thread(target=intrude, args=(n,)) for n in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(refusals) == 50 and all("is another refit job's" in m for m in refusals), refusals[:2]
        assert host.client.num_keys() == 1 and host.read("meta/train/0") == [1]
        assert host.client.gone() == []
        host.wait(["meta/train/0"], "train metadata")  # the setup goes on
    finally:
        host.close()
