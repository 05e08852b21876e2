"""Real refits over gloo between separately started train and gen processes (toy plugin)."""

import subprocess
import sys
import time

from toy_ranks import TRAIN_RANKS, refit_ranks

from refit_core.kit.launch import free_port, spawn

GEN_RANKS = 3


def run(steps=2, options=None, **kwargs):
    address = f"127.0.0.1:{free_port()}"
    return spawn(refit_ranks, TRAIN_RANKS + GEN_RANKS, address, steps, {"timeout_s": 30, **(options or {})},
                 kwargs.get("overrides"), kwargs.get("die_after_setup"), timeout_s=kwargs.get("spawn_timeout_s", 120))


def test_demo_refits_two_train_ranks_into_three_gen_ranks_twice_bitwise():
    """Two programs (2 train ranks: rows/experts/replicas; 3 gen ranks: columns, fused qkv,
    expert-dim shards, bf16), discovered through the toy plugin's entry point."""
    out = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "toy", "--gen", "toy",
                          "--steps", "2"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "toy engine: 3 ranks verified 2 versions bitwise" in out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith("verified OK")


def test_small_buckets_pipeline_many_rounds_within_the_memory_bound():
    bucket, buffers = 1024, 2
    results = run(steps=2, options={"bucket_bytes": bucket, "num_buffers": buffers})
    gen = [r for r in results if r["side"] == "gen"]
    for r in gen:
        checks = r["steps"][0::2]
        assert [c["mismatches"] for c in checks] == [[], []]
        assert [c["engine_version"] for c in checks] == [100, 101]
    for r in results:
        for stats in (s for s in r["steps"] if "staging" in s):
            assert stats["rounds"] > buffers  # really pipelined through reused buffers
            assert stats["staging"] <= bucket * buffers
        assert r["stats"]["peak_round_send_bytes"] <= bucket and r["stats"]["peak_round_recv_bytes"] <= bucket


def test_mismatched_model_fails_at_setup_on_every_rank_naming_the_tensor():
    results = run(overrides={"model.layers.0.self_attn.k_proj.weight": (24, 32)})
    assert all(r[0] == "error" for r in results)
    for kind, message in (r[1:] for r in results):
        assert kind == "PlanError"
        assert "model.layers.0.self_attn.k_proj.weight: source (24, 32) vs destination (16, 32)" in message, message


def test_a_peer_that_dies_gives_an_error_not_a_hang():
    start = time.monotonic()
    results = run(steps=1, options={"timeout_s": 10}, die_after_setup=1)
    gen_errors = [r for r in results[TRAIN_RANKS:] if isinstance(r, tuple)]
    assert gen_errors, results
    assert all(r[1] in ("TransferError", "StepFailedError") for r in gen_errors), gen_errors
    assert time.monotonic() - start < 150  # the 10 s deadline, plus starting 5 processes on a busy machine


def _unknown_model_on_the_host(rank: int, world: int, address: str):
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core import RefitOptions, RefitReceiver, RefitSender

    options = RefitOptions(timeout_s=30)
    start = time.monotonic()
    try:
        if rank == 0:  # the store's host fails before it learns anything about the gen side
            RefitSender(object(), rendezvous=address, rank=0, world_size=2, options=options).setup()
        elif rank == 1:
            time.sleep(1)
            RefitSender(ToyTrainer(1, 2), rendezvous=address, rank=1, world_size=2, options=options).setup()
        else:
            time.sleep(2)
            RefitReceiver(ToyEngine(0, 1), rendezvous=address, rank=0, world_size=1, options=options).setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "setup succeeded", time.monotonic() - start


def test_a_rank_failing_early_still_tells_every_other_rank_why():
    results = spawn(_unknown_model_on_the_host, 3, f"127.0.0.1:{free_port()}", timeout_s=120)
    assert results[0][0] == "PluginError"
    for kind, message, seconds in results:
        assert "no installed refit plugin recognizes the training model of type builtins.object" in message, message
        assert seconds < 25, (kind, seconds)  # nobody waited for the 30 s timeout (process start-up not counted)


def test_a_dead_gen_rank_is_a_transfer_error_naming_it_on_every_other_rank():
    """Gen rank 0 (refit rank 2) exits after setup: over gloo, posting to it or waiting on it fails, and
    every surviving rank reports a TransferError (never a raw RuntimeError; on gen ranks its subclass
    StepFailedError, with what the step touched), the train ranks naming it."""
    start = time.monotonic()
    dead = TRAIN_RANKS  # gen rank 0's rank in refit's process group
    results = run(steps=1, options={"timeout_s": 10}, die_after_setup=dead, spawn_timeout_s=240)
    survivors = [r for i, r in enumerate(results) if i != dead]
    assert all(isinstance(r, tuple) and r[1] == "TransferError" for r in survivors[:TRAIN_RANKS]), survivors
    assert all(isinstance(r, tuple) and r[1] in ("TransferError", "StepFailedError")
               for r in survivors[TRAIN_RANKS:]), survivors
    for kind, name, message in survivors[:TRAIN_RANKS]:
        assert f"and rank {dead} failed" in message, message
    assert time.monotonic() - start < 240  # the 10 s deadline, plus starting 5 processes on a busy machine
