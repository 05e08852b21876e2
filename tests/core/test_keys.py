"""The setup protocol's store keys: the strings every process of a job must agree on, and their parser."""

from refit_core.contract.side import Side
from refit_core.net.keys import (
    AGREED,
    OPTIONS,
    ColocatedRecord,
    RankId,
    RankRecord,
    barrier_keys,
    colocated_key,
    decision_key,
    landed_key,
    landed_keys,
    settled_key,
    step_prefixes,
    publisher,
    rank_key,
    rank_keys,
    rank_name,
    side_rank_keys,
    size_key,
)


def test_the_key_strings_stay_what_other_processes_expect():
    gen1 = RankId(Side.GEN, 1)
    assert str(gen1) == "gen/1" and gen1.name == "gen rank 1"
    assert (OPTIONS, AGREED) == ("options", "agreed")
    assert [rank_key(record, gen1) for record in RankRecord] == [
        "meta/gen/1", "placement/gen/1", "plan/gen/1", "fingerprint/gen/1", "done/gen/1"]
    assert rank_key(RankRecord.DONE, "train/0") == "done/train/0"  # a store identity works too
    assert rank_keys(RankRecord.FINGERPRINT, {Side.TRAIN: 1, Side.GEN: 2}) == [
        "fingerprint/train/0", "fingerprint/gen/0", "fingerprint/gen/1"]
    assert side_rank_keys(RankRecord.META, Side.TRAIN, 2) == ["meta/train/0", "meta/train/1"]
    assert (size_key(Side.TRAIN), size_key(Side.GEN)) == ("size/train", "size/gen")
    assert landed_key(3, 1) == "landed/3/gen/1" and landed_keys(0, 2) == ["landed/0/gen/0", "landed/0/gen/1"]
    assert decision_key(3) == "decision/3/train/0" and settled_key(3, 1) == "settled/3/gen/1"
    keys = [landed_key(3, 1), decision_key(3), settled_key(3, 0)]
    assert all(any(k.startswith(p) for p in step_prefixes(3)) for k in keys)
    assert not any(k.startswith(p) for p in step_prefixes(1) for k in [*keys, decision_key(13), landed_key(10, 0)])
    assert colocated_key(0, 2, ColocatedRecord.EXPORTS) == "colocated/0>2/exports"
    assert colocated_key(1, 0, ColocatedRecord.CONTROL) == "colocated/1>0/control"
    assert barrier_keys(AGREED) == barrier_keys("agreed") and barrier_keys("agreed").all == "agreed/all"
    assert barrier_keys("agreed").count == "agreed/count"


def test_every_rank_key_parses_back_to_its_publisher():
    for who in (RankId(Side.TRAIN, 0), RankId(Side.GEN, 7)):
        for record in RankRecord:
            assert publisher(rank_key(record, who)) == who
        assert publisher(str(who)) == who
    assert publisher(landed_key(4, 2)) == RankId(Side.GEN, 2)
    assert publisher(size_key(Side.GEN)) == RankId(Side.GEN, 0)  # a side-wide key: its rank 0 publishes it
    assert publisher(OPTIONS) is None and publisher("agreed/all") is None
    assert rank_name("done/train/3") == "train rank 3" and rank_name("size/train") == "train rank 0"
    assert rank_name("gen/0") == "gen rank 0" and rank_name(OPTIONS) == "options"
