"""A ``send()`` called wrongly is refused by name on every rank, before any byte moves, and the job sets up
again and goes on bitwise (issue 44): a version that goes backwards (5 -> 3) or repeats, one of 2**63 or
more, a negative one, a subset naming a tensor the plan does not move; ``reset=True`` starts a new sequence."""

import pytest
from harness import Ranks
from refusal_ranks import Call, refusal_rank

from refit_core.kit.launch import free_port

TRAIN, GEN = 2, 2
TIMEOUT_S = 20
"""Each refusal must end far sooner: nothing waits on a deadline."""
REFUSED_S = 6.0
"""How long a refused step may take on any rank (the store's host keeps the store up to 2 s for the
gen ranks to read the cause)."""
CALLS = (
    Call(0, 5),
    Call(1, 3),  # backwards
    Call(1, 5),  # the same again
    Call(1, 2**63),  # out of range
    Call(1, -7),
    Call(1, 6, only=("model.nope.weight",)),
    Call(1, 3, reset=True),
    Call(0, 4),
)
CAUSES = {
    1: "weight version 3 is not greater than the last version sent, 5",
    2: "weight version 5 is not greater than the last version sent, 5",
    3: f"weight version {2**63} is out of range",
    4: "weight version -7 is out of range",
    5: "the plan does not move: model.nope.weight (the plan moves 6 tensor(s): model.embed_tokens.weight, ",
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_a_wrong_version_or_subset_is_refused_by_name_on_every_rank_and_the_job_goes_on(mode):
    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    options = {"secret": "h3-refusals", "timeout_s": TIMEOUT_S, "bucket_bytes": 1024, "num_buffers": 2, "mode": mode}
    try:
        for rank in range(TRAIN + GEN):
            ranks.start(refusal_rank, rank, address, TRAIN, GEN, CALLS, options)
        ranks.release()
        got = ranks.wait_for([(r, "result") for r in range(TRAIN + GEN)], timeout_s=240)
    finally:
        ranks.close()
    for rank in range(TRAIN + GEN):
        calls = got[(rank, "result")]
        for index, cause in CAUSES.items():
            r = calls[index]
            assert "error" in r, (rank, index, r)
            assert cause in r["message"], (rank, index, r["message"])
            assert "a peer died" not in r["message"].split(cause)[0], (rank, index, r["message"])
            assert r["seconds"] < REFUSED_S, (rank, index, r)
        for index in (0, 6, 7):
            assert calls[index]["ok"], (rank, index, calls[index])
            if rank >= TRAIN:
                assert calls[index]["bitwise"], (rank, index, calls[index])
                assert calls[index]["version"] == CALLS[index].version, (rank, index, calls[index])
