"""A fleet whose replicas come and go (:mod:`refit_core.fleet`): toy trainers over gloo in real processes, engine
replicas that die mid-step, restart under their name, join late, or try to join under a name in use."""

import os
import random
import tempfile
import time

import pytest
from fleet_ranks import FIRST_VERSION, deserter_rank, gate, impostor_rank, replica_rank, trainer_rank
from harness import Ranks

from refit_core.contract.errors import RefitError
from refit_core.contract.options import FleetOptions, StoreLimits
from refit_core.contract.errors import WireError
from refit_core.fleet.records import Admission, FeedReport, JoinRequest, Member, ReplicaState, StepStart
from refit_core.fleet.roster import MINUTE_S, Roster
from refit_core.fleet.status import read_fleet
from refit_core.kit.launch import free_port
from refit_core.net import wire
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.store_protocol import ERROR_KEY
from refit_core.tools import cli

TRAIN = 2
STEPS = 20
DEADLINE_S = 10 + 5  # the ranks' timeout_s, and what a loaded 2-core machine adds


def requests(replica: str, size: int, first_ticket: int, ranks: range | None = None) -> list[JoinRequest]:
    return [JoinRequest(replica, r, size, first_ticket + i) for i, r in enumerate(ranks or range(size))]


def addresses():
    count = iter(range(1000))
    return lambda: f"127.0.0.1:{20000 + next(count)}"


def test_the_roster_admits_a_replica_once_all_its_ranks_asked_and_refuses_by_name():
    roster, address = Roster(), addresses()
    first = roster.consider(requests("a", 2, 1, range(1)), lambda m: True, address, 0.0)
    assert first.admissions == {} and not roster.members  # rank 1 has yet to ask
    second = roster.consider(requests("a", 2, 2, range(1, 2)), lambda m: True, address, 1.0)
    assert [m.replica for m in second.admitted] == ["a"] and set(second.admissions) == {1, 2}
    assert all(a.member == second.admitted[0] and a.refused is None for a in second.admissions.values())
    again = roster.consider(requests("a", 2, 3), lambda m: True, address, 2.0)  # "a" is alive: refused
    assert set(again.admissions) == {3, 4} and not again.admitted
    assert all("replica a is already in the fleet" in a.refused for a in again.admissions.values())
    restart = roster.consider(requests("a", 2, 5), lambda m: False, address, 3.0)  # its ranks left: replaced
    assert [m.incarnation for m in restart.admitted] == [5] and [m.incarnation for m in restart.replaced] == [1]
    odd = roster.consider([JoinRequest("b", 0, 2, 7), JoinRequest("b", 1, 3, 8)], lambda m: True, address, 4.0)
    assert all("disagree on its size" in a.refused for a in odd.admissions.values()) and "b" not in roster.members


def test_the_roster_holds_the_fleet_to_its_limits_and_names_them():
    roster, address = Roster(StoreLimits(max_replicas=2, max_joins_per_minute=3)), addresses()
    for i, name in enumerate("ab"):
        assert roster.consider(requests(name, 1, i + 1), lambda m: True, address, 0.0).admitted
    full = roster.consider(requests("c", 1, 3), lambda m: True, address, 1.0)
    assert "StoreLimits.max_replicas" in full.admissions[3].refused
    roster.drop("a")
    assert roster.consider(requests("c", 1, 4), lambda m: True, address, 2.0).admitted  # the third join this minute
    roster.drop("c")
    fast = roster.consider(requests("d", 1, 5), lambda m: True, address, 3.0)
    assert "StoreLimits.max_joins_per_minute" in fast.admissions[5].refused
    assert roster.consider(requests("d", 1, 6), lambda m: True, address, MINUTE_S + 1).admitted
    superseded = roster.consider([JoinRequest("e", 0, 2, 7), JoinRequest("e", 0, 2, 8)], lambda m: True, address, 99)
    assert "superseded" in superseded.admissions[7].refused and 8 not in superseded.admissions


def test_only_a_fleets_store_admits_replica_identities_and_a_duplicate_fails_alone():
    """A plain job's store refuses replica identities; a fleet's admits them, refuses a second connection under
    a connected one's identity without failing the job, and admits it at once once that one's process died."""
    credentials = JobCredentials.of("refit", "fleet-test")

    def joins(address: str, who: str) -> Rendezvous:
        return Rendezvous(address, host=False, who=who, timeout_s=5, credentials=credentials)

    address = f"127.0.0.1:{free_port()}"
    plain = Rendezvous(address, host=True, who="train/0", timeout_s=5, credentials=credentials)
    try:
        with pytest.raises(RefitError, match="is not a refit rank's identity"):
            joins(address, "replica/a/0")
    finally:
        plain.close()
    address = f"127.0.0.1:{free_port()}"
    fleet = Rendezvous(address, host=True, who="train/0", timeout_s=5, credentials=credentials, guests=True)
    first = joins(address, "replica/a/0")
    try:
        with pytest.raises(RefitError, match="replica/a/0 is already connected to this refit fleet"):
            joins(address, "replica/a/0")
        assert fleet.client.try_get(ERROR_KEY) is None  # the job goes on
        joins(address, "replica/b/0").close()
        first.client._sock.close()  # its process died: a restart under its name is admitted at once
        first = joins(address, "replica/a/0")
        assert "replica/a/0" in fleet.server.present()
    finally:
        first.close()
        fleet.close()


@pytest.mark.slow
def test_a_fleet_keeps_refitting_while_replicas_die_restart_and_join(capsys):
    """2 train ranks, replicas r0 (1 rank), r1 (2 ranks) and r2 (1 rank); over 20 steps r2 is killed at a random
    point of a random step and restarted under its name, r3 joins late, and an impostor asks to join as r0.
    The trainers open the fleet once and never set up again; every replica holds every version it receives
    bitwise; the survivors get every step; the restarted and added replicas get the step after they asked,
    whole; the impostor is refused by name; every step ends within its deadline."""
    rng = random.Random(2026)
    kill_at, add_at = rng.randrange(3, 8), 12
    last = FIRST_VERSION + STEPS - 1
    folder, address = tempfile.mkdtemp(prefix="refit-fleet-"), f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        for r in range(TRAIN):
            ranks.start(trainer_rank, r, address, TRAIN, STEPS, folder)
        replicas = {10: ("r0", 0, 1), 11: ("r1", 0, 2), 12: ("r1", 1, 2), 13: ("r2", 0, 1)}
        for rank, (name, local, size) in replicas.items():
            ranks.start(replica_rank, rank, address, name, local, size, last)
        ranks.release()

        def asks(tickets: int) -> None:  # the join requests are in before the next step starts
            deadline = time.monotonic() + 60
            while read_fleet(address).join_requests < tickets:
                assert time.monotonic() < deadline, f"fewer than {tickets} join requests after 60 s"
                time.sleep(0.05)

        asks(4)
        steps = []
        for step in range(STEPS):
            if step == kill_at + 1:
                ranks.start(replica_rank, 14, address, "r2", 0, 1, last)
                asks(5)
            if step == add_at:
                ranks.start(replica_rank, 15, address, "r3", 0, 1, last)
                ranks.start(impostor_rank, 16, address, "r0")
                asks(6)  # the impostor is refused at the fleet's store, before it draws a ticket
            open(gate(folder, step), "w").close()
            if step == kill_at:
                time.sleep(rng.uniform(0.0, 0.03))
                ranks.kill(13)
            got = ranks.wait_for([(r, "step") for r in range(TRAIN)], 60)
            steps.append([got[(r, "step")] for r in range(TRAIN)])
            for r in range(TRAIN):
                del ranks.seen[(r, "step")]
            if step == STEPS - 2:  # the running job's view, from outside, as `refit status` prints it
                assert cli.main(["status", address]) == 0
                status = capsys.readouterr().out
        results = ranks.wait_for([(r, "result") for r in (0, 1, 10, 11, 12, 14, 15, 16)], 60)
    finally:
        ranks.close()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)

    for step, (lead, other) in enumerate(steps):
        assert (lead["landed"], sorted(lead["failed"])) == (other["landed"], sorted(other["failed"])), (step, steps)
        assert lead["seconds"] < DEADLINE_S, (step, lead)
        assert {"r0", "r1"} <= set(lead["landed"]), (step, lead)
        assert ("r2" in lead["landed"]) == (step < kill_at or step > kill_at), (step, kill_at, lead)
        assert ("r3" in lead["landed"]) == (step >= add_at), (step, lead)
    assert sorted(steps[0][0]["joined"]) == ["r0", "r1", "r2"]
    assert steps[kill_at + 1][0]["joined"] == ["r2"] and steps[add_at][0]["joined"] == ["r3"]
    for r in range(TRAIN):
        assert results[(r, "result")]["opened"] == 1
    view = {name: (version, error) for name, version, _, _, error in results[(0, "result")]["fleet"]}
    assert view == {name: (last, None) for name in ("r0", "r1", "r2", "r3")}, view
    first = {10: FIRST_VERSION, 11: FIRST_VERSION, 12: FIRST_VERSION, 14: FIRST_VERSION + kill_at + 1,
             15: FIRST_VERSION + add_at}
    for rank, start in first.items():
        held = results[(rank, "result")]["held"]
        assert held == [(v, True) for v in range(start, last + 1)], (rank, held)
    assert "replica/r0/0 is already connected to this refit fleet" in results[(16, "result")]["error"]
    rows = {line.split()[0]: line.split()[1:3] for line in status.splitlines()[1:-1]}
    assert status.splitlines()[-1] == "join requests so far: 6"
    assert rows == {name: [str(size), str(last - 1)] for name, size in (("r0", 1), ("r1", 2), ("r2", 1), ("r3", 1))}


@pytest.mark.parametrize("membership", ["per_replica", "strict"])
def test_a_replica_that_dies_after_its_admission_fails_its_step_at_once(membership):
    """A replica rank that dies after the fleet admitted it, before it came to its job's store: every train rank
    fails that replica's step within seconds (it was still in the fleet's store, then in neither), not at the
    10 s deadline; the other replica lands every step, and the dead one is dropped. Under strict membership that
    step raises ``FleetStepError`` on every train rank, naming the lost replica and the one that holds the step;
    per replica, no step raises."""
    steps, last = 3, FIRST_VERSION + 2
    folder, address = tempfile.mkdtemp(prefix="refit-fleet-"), f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        for r in range(TRAIN):
            ranks.start(trainer_rank, r, address, TRAIN, steps, folder, {"fleet": {"membership": membership}})
        ranks.start(replica_rank, 10, address, "r0", 0, 1, last)
        ranks.start(deserter_rank, 11, address, "d")
        ranks.release()
        deadline = time.monotonic() + 60
        while read_fleet(address).join_requests < 2:
            assert time.monotonic() < deadline, "the replicas did not ask to join within 60 s"
            time.sleep(0.05)
        reports = []
        for step in range(steps):
            open(gate(folder, step), "w").close()
            got = ranks.wait_for([(r, "step") for r in range(TRAIN)], 60)
            reports.append([got[(r, "step")] for r in range(TRAIN)])
            for r in range(TRAIN):
                del ranks.seen[(r, "step")]
        held = ranks.wait_for([(10, "result")], 60)[(10, "result")]["held"]
    finally:
        ranks.close()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    for lead, other in reports:
        assert (lead["landed"], sorted(lead["failed"])) == (other["landed"], sorted(other["failed"])), reports
    first = reports[0][0]
    assert first["landed"] == ["r0"] and list(first["failed"]) == ["d"], first
    assert "replica d rank(s) [0] left after the fleet admitted it" in first["failed"]["d"], first
    assert max(report["seconds"] for report in reports[0]) < 5, reports[0]  # the deadline is 10 s
    assert [(r[0]["landed"], r[0]["failed"]) for r in reports[1:]] == [(["r0"], {})] * 2, reports
    assert held == [(v, True) for v in range(FIRST_VERSION, last + 1)], held
    raised = [[report["raised"] for report in step] for step in reports]
    if membership == "strict":
        assert all("lost 1 replica(s) under strict membership: d: its setup failed: replica d rank(s) [0] left" in error
                   and "held by ['r0']" in error for error in raised[0]), raised
        assert raised[1:] == [[None, None]] * 2, raised
    else:
        assert raised == [[None, None]] * 3, raised


def test_the_roster_grows_a_relay_tree_of_one_layout_and_drops_a_feeder_with_its_subtree():
    roster, address = Roster(shape=FleetOptions(direct=1, fanout=2)), addresses()
    for ticket, name in enumerate(("a", "b", "c", "d", "e"), start=1):
        roster.consider([JoinRequest(name, 0, 1, ticket, "L")], lambda m: True, address, 0.0)
    roster.consider([JoinRequest("x", 0, 1, 9, "")], lambda m: True, address, 0.0)  # cannot be fed: trainers feed it
    feeders = {m.replica: m.feeder for m in roster.members.values()}
    assert feeders == {"a": None, "b": "a", "c": "a", "d": "b", "e": "b", "x": None}, feeders
    assert [roster.members[n].address == "" for n in "abcdex"] == [False, True, True, True, True, False]
    assert [m.replica for m in roster.drop("b")] == ["b", "d", "e"] and set(roster.members) == {"a", "c", "x"}
    again = roster.consider([JoinRequest("d", 0, 1, 10, "L")], lambda m: True, address, 1.0)
    assert again.admitted[0].feeder == "a"  # re-attached where there is room, the shallowest first


@pytest.mark.slow
def test_a_relay_fleet_loses_a_feeder_mid_step_and_reattaches_its_children():
    """One train rank feeds r0 only (``FleetOptions(direct=1, fanout=2)``); r0 forwards each step to r1 and r2, and
    r1 to r3. r1 is killed at a random point of step 2: r1, and r3 below it unless r3 already had the step, miss
    that step alone (failed, or dropped if r1 died before train rank 0 began it); r0 and r2 land every step. r3
    rejoins and is re-attached to another holder, r1 restarts under its name, r4 joins late: each holds the step
    after it asked, whole. Every version any replica holds is
    bitwise the trainers'; the trainer never sets up again; every step ends within its deadline."""
    rng = random.Random(49)
    steps, kill_at, add_at = 7, 2, 5
    last = FIRST_VERSION + steps - 1
    folder, address = tempfile.mkdtemp(prefix="refit-fleet-"), f"127.0.0.1:{free_port()}"
    ranks = Ranks()

    def asks(tickets: int) -> None:
        deadline = time.monotonic() + 60
        while read_fleet(address).join_requests < tickets:
            assert time.monotonic() < deadline, f"fewer than {tickets} join requests after 60 s"
            time.sleep(0.05)

    try:
        ranks.start(trainer_rank, 0, address, 1, steps, folder, {"fleet": {"direct": 1, "fanout": 2}})
        ranks.release()
        for i, name in enumerate(("r0", "r1", "r2", "r3")):  # one after the other: the tree follows the tickets
            ranks.start(replica_rank, 10 + i, address, name, 0, 1, last)
            asks(i + 1)
        reports = []
        for step in range(steps):
            if step == kill_at + 1:
                ranks.start(replica_rank, 20, address, "r1", 0, 1, last)
                asks(6)  # the restarted r1 and r3, which lost its feeder
            if step == add_at:
                ranks.start(replica_rank, 21, address, "r4", 0, 1, last)
                asks(7)
            open(gate(folder, step), "w").close()
            if step == kill_at:
                time.sleep(rng.uniform(0.0, 0.05))
                ranks.kill(11)
            reports.append(ranks.wait_for([(0, "step")], 60)[(0, "step")])
            del ranks.seen[(0, "step")]
        results = ranks.wait_for([(r, "result") for r in (0, 10, 12, 13, 20, 21)], 60)
    finally:
        ranks.close()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)

    assert reports[0]["feeders"] == {"r0": None, "r1": "r0", "r2": "r0", "r3": "r1"}, reports[0]
    for step, report in enumerate(reports):
        assert report["seconds"] < DEADLINE_S, (step, report)
        assert {"r0", "r2"} <= set(report["landed"]), (step, report)
        if step != kill_at:
            assert {"r1", "r3"} <= set(report["landed"]) and not report["failed"], (step, report)
    # r1 failed step 2, or landed it and died after, or died before train rank 0 began it (dropped, with r3)
    assert "r1" in reports[kill_at + 1]["joined"] and reports[add_at]["joined"] == ["r4"], reports
    assert "r3" in reports[kill_at]["joined"] + reports[kill_at + 1]["joined"], reports
    feeders, final = reports[-1]["feeders"], reports[-1]["landed"]
    assert feeders["r0"] is None and sorted(final) == ["r0", "r1", "r2", "r3", "r4"], reports[-1]
    assert all(feeders[name] in final and feeders[name] != name for name in final if name != "r0"), feeders
    assert results[(0, "result")]["opened"] == 1
    for rank, start in {10: FIRST_VERSION, 12: FIRST_VERSION, 20: FIRST_VERSION + kill_at + 1,
                        21: FIRST_VERSION + add_at}.items():
        assert results[(rank, "result")]["held"] == [(v, True) for v in range(start, last + 1)], rank
    held = results[(13, "result")]["held"]  # r3: every version but perhaps the one its feeder died in
    assert all(bitwise for _, bitwise in held) and [v for v, _ in held if v != FIRST_VERSION + kill_at] == [
        v for v in range(FIRST_VERSION, last + 1) if v != FIRST_VERSION + kill_at], held


def test_the_fleets_records_travel_as_json_and_a_malformed_one_is_refused_by_name():
    member = Member("r1", "", 2, 7, feeder="r0", layout="ab12")
    records = [Admission(member), Admission(None, "full"), StepStart(101, 3, (member, Member("r0", "h:1", 1, 2))),
               FeedReport(True, layout="f00d"), FeedReport(False, "it died"),
               ReplicaState("r1", 2, 101, 5.0, "f00d", None, "r0")]
    for record in records:
        encoded = wire.encode(record.to_wire())
        assert type(record).from_wire(wire.decode(encoded, "test")) == record
    assert JoinRequest.from_wire(4, JoinRequest("r1", 1, 2, 4, "ab12").to_wire()) == JoinRequest("r1", 1, 2, 4, "ab12")
    bad = [(Member, {**member.to_wire(), "feeder": 3}), (Admission, {"member": member.to_wire(), "refused": "x"}),
           (StepStart, {"version": 1, "step": 0, "members": "r0"}),
           (FeedReport, {"landed": 1, "reason": "", "layout": ""}),
           (ReplicaState, {**records[-1].to_wire(), "feeder": ["r0"]})]
    for cls, data in bad:
        with pytest.raises(WireError):
            cls.from_wire(data)
    with pytest.raises(WireError, match="field 'layout'"):
        JoinRequest.from_wire(5, {"replica": "r1", "rank": 0, "gen_ranks": 1, "layout": "x" * 65})
