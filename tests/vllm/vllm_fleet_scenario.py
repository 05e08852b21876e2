"""The fleet scenario of ``test_vllm_fleet.py``: FSDP2 trainers refit a real vLLM engine replica and cheap
replicas step by step, while a cheap replica is killed mid-step, restarts under its name and another joins.

``python vllm_fleet_scenario.py --serve`` is a ``scenario_server`` fork server for it (scenario ``fleet``);
the scenario's process forks every rank program (``vllm_fleet_ranks.py``) from itself: it imported vLLM,
torch and refit before, and computes nothing, so that each rank starts at once, safe to fork.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import scenarios
from vllm_fleet_ranks import FIRST_VERSION, TIMEOUT_S, model_replica, trainer_rank, vllm_replica

from refit_core import RefitError
from refit_core.apps import free_port
from refit_core.fleet.status import read_fleet
from refit_core.net.auth import new_secret

TRAIN = 2


def _entry(fn: Callable[..., Any], who: str, events: Any, args: tuple) -> None:
    try:
        result = fn(lambda event, payload=None: events.put((who, event, payload)), *args)
    except BaseException:  # noqa: BLE001 - reported to the driver, which fails the scenario with it
        events.put((who, "crash", traceback.format_exc()))
        raise SystemExit(1)
    events.put((who, "result", result))


class Crew:
    """Rank programs forked from this process, each under a name, and the events they report in order."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("fork")
        self.events = self.ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.unread: dict[tuple[str, str], list[Any]] = {}
        self.log: list[tuple[str, str, Any]] = []

    def start(self, who: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(report, *args)`` in a new process named ``who``."""
        self.procs[who] = self.ctx.Process(target=_entry, args=(fn, who, self.events, args), daemon=True)
        self.procs[who].start()

    def wait_for(self, wanted: list[tuple[str, str]], timeout_s: float) -> dict[tuple[str, str], Any]:
        """The next unread payload of every ``(who, event)`` in ``wanted``, waiting for them; a rank's crash,
        or the deadline, raises."""
        deadline = time.monotonic() + timeout_s
        while not all(self.unread.get(w) for w in wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [w for w in wanted if not self.unread.get(w)]
                raise AssertionError(f"no {missing} within {timeout_s:.0f} s; events so far: {self.log}")
            try:
                self._record(*self.events.get(timeout=min(left, 0.5)))
            except queue.Empty:
                continue
        return {w: self.unread[w].pop(0) for w in wanted}

    def _record(self, who: str, event: str, payload: Any) -> None:
        """Keep one reported event; a rank's crash raises."""
        if event == "crash":
            raise AssertionError(f"{who} crashed:\n{payload}")
        self.log.append((who, event, payload))
        self.unread.setdefault((who, event), []).append(payload)

    def asks(self, address: str, tickets: int, timeout_s: float = 120) -> None:
        """Wait until the fleet at ``address`` holds ``tickets`` join requests (one per replica rank so far):
        they are in before the next step, which admits them."""
        deadline = time.monotonic() + timeout_s
        while self._join_requests(address) < tickets:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {tickets} join requests after {timeout_s:.0f} s: {self.log}")
            self._drain()
            time.sleep(0.05)

    @staticmethod
    def _join_requests(address: str) -> int:
        try:
            return read_fleet(address).join_requests
        except RefitError:  # train rank 0 has yet to open the fleet's store
            return 0

    def _drain(self) -> None:
        """Read the events reported so far; a rank's crash raises."""
        while True:
            try:
                self._record(*self.events.get_nowait())
            except queue.Empty:
                return

    def kill(self, who: str) -> None:
        proc = self.procs[who]
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited since is_alive()
                pass
        proc.join(timeout=10)

    def close(self) -> None:
        for who in self.procs:
            self.kill(who)


def scenario_fleet(steps: int, seed: int) -> dict[str, Any]:
    """2 FSDP2 train ranks refit replica ``vllm`` (a vLLM engine) and the cheap replicas ``m1`` and ``m2`` for
    ``steps`` steps; ``m2`` is killed at a random point of a random step and restarted under its name, two steps
    later the engine is killed the same way and restarted under its name (a new engine), and ``m3`` joins later.
    Returns every step's ``FleetStep`` as each train rank saw it and every rank's result."""
    os.environ["REFIT_PLUGINS"] = "dtensor,vllm"  # every other installed plugin costs imports, and is not used
    os.environ["REFIT_SECRET"] = os.environ.get("REFIT_SECRET") or new_secret()  # the ranks are one job
    rng = random.Random(seed)
    kill_at = rng.randrange(2, steps // 2)
    engine_kill_at = kill_at + 2
    add_at = max(engine_kill_at + 2, 2 * steps // 3)
    last = FIRST_VERSION + steps - 1
    address, port = f"127.0.0.1:{free_port()}", free_port()
    crew = Crew()
    gates = [crew.ctx.Event() for _ in range(steps)]
    out: dict[str, Any] = {"kill_at": kill_at, "engine_kill_at": engine_kill_at, "add_at": add_at, "last": last,
                           "timeout_s": TIMEOUT_S, "steps": []}
    began = time.perf_counter()
    try:
        crew.start("vllm", vllm_replica, address, "vllm", last)  # first: its engine takes longest to build
        for rank in range(TRAIN):
            crew.start(f"train{rank}", trainer_rank, rank, TRAIN, port, address, gates)
        for name in ("m1", "m2"):
            crew.start(name, model_replica, address, name, last)
        crew.asks(address, 3, timeout_s=600)
        out["ready_s"] = time.perf_counter() - began
        for step in range(steps):
            if step == kill_at + 1:
                crew.start("m2-restarted", model_replica, address, "m2", last)
                crew.asks(address, 4)
            if step == engine_kill_at + 1:  # a new engine: built, then asks (about 30 s on 2 cores)
                crew.start("vllm-restarted", vllm_replica, address, "vllm", last)
                crew.asks(address, 5, timeout_s=600)
            if step == add_at:
                crew.start("m3", model_replica, address, "m3", last)
                crew.asks(address, 6)
            gates[step].set()
            if step in (kill_at, engine_kill_at):
                time.sleep(rng.uniform(0.0, 0.03))
                crew.kill("m2" if step == kill_at else "vllm")
            got = crew.wait_for([(f"train{r}", "step") for r in range(TRAIN)], 180)
            out["steps"].append([got[(f"train{r}", "step")] for r in range(TRAIN)])
        out["steps_s"] = time.perf_counter() - began - out["ready_s"]
        who = [f"train{r}" for r in range(TRAIN)] + ["vllm-restarted", "m1", "m2-restarted", "m3"]
        results = crew.wait_for([(w, "result") for w in who], 300)
        out["results"] = {w: results[(w, "result")] for w in who}
        out["killed_held"] = {killed: [payload for w, event, payload in crew.log if (w, event) == (killed, "held")]
                              for killed in ("m2", "vllm")}
    finally:
        crew.close()
    return out


scenarios.SCENARIOS["fleet"] = scenario_fleet

if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        import scenario_server

        scenario_server.serve(scenarios.run_one)
    else:
        scenarios.run_one(sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
