"""A real refit carried by a third-party transport: the example plugin's ``toy-tcp`` moves a toy trainer's
two steps into a toy engine (2 train ranks, 2 gen ranks, separate processes), bit for bit; and a transport
name nobody installed fails setup on every rank, naming the installed ones, before any collective."""

from __future__ import annotations

from transport_ranks import TRAIN_RANKS, toy_refit

from refit_core.kit.launch import free_port, spawn

GEN_RANKS = 2


def _run(train_options: dict, gen_options: dict, steps: int = 2) -> list[dict]:
    return spawn(toy_refit, TRAIN_RANKS + GEN_RANKS, f"127.0.0.1:{free_port()}", steps, train_options, gen_options,
                 timeout_s=120)


def test_the_toy_tcp_transport_carries_two_steps_bitwise_with_the_train_sides_options():
    train = {"timeout_s": 30, "transport": "toy-tcp", "bucket_bytes": 4096,
             "transport_options": {"toy-tcp": {"chunk_bytes": 1000}}}
    results = _run(train, {"timeout_s": 30})  # the gen side adopts the transport and its options
    assert all("error" not in r for r in results), results
    assert {r["kind"] for r in results} == {"toy-tcp"}
    assert {r["options"] for r in results} == {"TcpOptions(chunk_bytes=1000, nodelay=True)"}
    assert all(r["registered"] == r["direct"] for r in results), results  # bind registers the direct regions
    assert any(r["direct"] > 0 for r in results), results
    for gen in results[TRAIN_RANKS:]:
        assert [s["version"] for s in gen["steps"]] == [100, 101]
        assert all(s["mismatches"] == [] for s in gen["steps"]), gen


def test_an_unknown_transport_fails_setup_on_every_rank_naming_the_installed_ones():
    """Every rank resolves the agreed name itself, before any collective; a rank still at the agreement
    barrier when a faster one failed hears that rank's error through the rendezvous (a RefitError)."""
    results = _run({"timeout_s": 60, "transport": "nixl"}, {"timeout_s": 60}, steps=1)
    assert any(r.get("error") == "OptionError" for r in results), results
    for r in results:
        assert r.get("error") in ("OptionError", "RefitError"), results
        assert "no transport named 'nixl' is installed (installed: gloo, ipc, nccl" in r["message"]
        assert "toy-tcp" in r["message"] and r["seconds"] < 45  # no rank waited for the timeout
