"""Real refits between separately started DTensor programs over gloo (CPU), checked bit for bit.

Each layout pair is one spawn of S train + D gen processes (each side its own process group and
mesh) running every model case in turn; the tests below read that spawn's results. Sources:
FSDP2 (2 ranks), TP (2 ranks), 2-D FSDP2 x TP (4 ranks, ``_StridedShard``) and plain replicated
modules; every source goes into a destination with a different layout. Each case refits two steps
with different weights and compares with ground truth built by transformers alone.
"""

import pytest
from dtensor_ranks import REPLICATED, case_id, refit_ranks, write_truth

from refit_core.kit.launch import free_port, spawn

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe"]
LLAMA, QWEN3, TIED, MOE = ({"model": m} for m in MODELS)
# What each model adds (the TP plan goes by module name and kind, so the same modules shard alike in
# every model): tiny-llama, untied embeddings and lm_head, a dense MLP; tiny-qwen3, tiny-llama's very
# parameters plus q/k norms; tiny-qwen3-tied, the tie (embeddings left replicated under TP) with a dense
# MLP and q/k norms; tiny-qwen3-moe, fused experts with untied embeddings and q/k norms. So tiny-qwen3
# repeats tiny-llama plus tiny-qwen3-tied's norms, and a pair runs it only where no other case covers
# its checks: tp2-to-2d's sharded forward of an untied model under TP (tiny-llama is not there; a TP
# MoE has no sharded forward). tiny-llama stays in fsdp2-to-tp2 (the fp32 twin of its bf16 case, and
# the untied sharded forward under TP) and in the replicated pair (which splits its sends).

# name: (source layout, train ranks, destination layout, gen ranks, cases)
PAIRS = {
    "fsdp2-to-tp2": ("fsdp=2", 2, "tp=2", 2, [
        LLAMA, TIED, MOE,
        {"model": "tiny-llama", "dtype": "bfloat16"},
        {"model": "tiny-qwen3-tied", "shard_tied_embeddings": True},
    ]),
    "tp2-to-2d": ("tp=2", 2, "fsdp=2,tp=2", 4, [QWEN3, TIED, MOE]),
    "2d-to-fsdp2": ("fsdp=2,tp=2", 4, "fsdp=2", 2, [TIED, MOE]),
    "replicated2-to-fsdp2": (REPLICATED, 2, "fsdp=2", 2, [LLAMA, MOE]),
}
MISMATCH = ("fsdp2-to-tp2", {"intermediate_size": 192})
"""The pair whose ranks, after their cases, set up once more with this in the gen side's config (a
stock tiny Llama on the train side): the spawn a test of its own would cost is most of its time."""
MATRIX = [(pair, case_id(case)) for pair, (*_, cases) in PAIRS.items() for case in cases
          if case_id(case).endswith(":float32")]


@pytest.fixture(scope="module")
def truth_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("truth"))
    for model in MODELS:
        write_truth(directory, model)
    return directory


@pytest.fixture(scope="module")
def refits(truth_dir):
    """Runs each layout pair once (on first use) and keeps its per-rank results."""
    done = {}

    def run(pair):
        if pair not in done:
            src, s, dst, d, cases = PAIRS[pair]
            ports = [free_port() for _ in range(3 + len(cases))]
            mismatch = MISMATCH[1] if pair == MISMATCH[0] else None
            try:
                results = spawn(refit_ranks, s + d, s, ports, src, dst, cases, truth_dir, mismatch, timeout_s=400)
                done[pair] = (results[:s], results[s:])
            except Exception as exc:  # noqa: BLE001 - every test of the pair reports it
                done[pair] = exc
        if isinstance(done[pair], Exception):
            raise done[pair]
        return done[pair]
    return run


def _ids(items):
    return [f"{case}-{pair}" for pair, case in items]


@pytest.mark.parametrize("pair,case", MATRIX, ids=_ids(MATRIX))
def test_two_successive_refits_are_bitwise_equal_to_the_source_weights(refits, pair, case):
    train, gen = refits(pair)
    for rank in train:
        assert rank[case]["source_equal_1"] and rank[case]["source_equal_2"]
    for rank, result in enumerate(gen):
        checks = result[case]
        for step in (1, 2):
            assert checks[f"version_{step}"] == step
            assert checks[f"params_mismatch_{step}"] == [], f"gen rank {rank} step {step}"
            assert checks[f"pieces_mismatch_{step}"] == [], f"gen rank {rank} step {step}"


def _own_forward(pair: str, case: str) -> tuple[str, ...]:
    """The checks of the gen side's own sharded forward: exact without tensor parallel, to 1e-5 with it
    (sums reordered); none for a tensor-parallel MoE (its expert-parallel experts have no sharded forward)."""
    if "tp=" not in PAIRS[pair][2]:
        return ("own_forward_equal",)
    return () if case.startswith("tiny-qwen3-moe:") else ("own_forward_close",)


@pytest.mark.parametrize("pair,case", MATRIX, ids=_ids(MATRIX))
def test_refitted_destination_gives_the_source_logits(refits, pair, case):
    _, gen = refits(pair)
    for result in gen:
        for step in (1, 2):
            logits = result[case][f"logits_{step}"]
            assert logits["gathered_equal"]
            own = {key: value for key, value in logits.items() if key.startswith("own_forward")}
            assert own == {key: True for key in _own_forward(pair, case)}, logits
    if pair.endswith("fsdp2"):
        assert all(r[case]["logits_2"]["own_forward_equal"] for r in gen)  # FSDP2 forward: exact


@pytest.mark.parametrize("pair,case", MATRIX, ids=_ids(MATRIX))
def test_source_pieces_assemble_to_the_transformers_checkpoint(refits, pair, case):
    """Every train rank's pieces, gathered, equal transformers' own checkpoint of the unsharded
    model (no element missing, replicas identical); full_tensor() agrees with the plain model."""
    train, _ = refits(pair)
    assert train[0][case]["pieces_vs_transformers"] == []
    assert all(rank[case]["full_tensor_equal"] for rank in train)


@pytest.mark.parametrize("pair,case", [m for m in MATRIX if not m[0].startswith(REPLICATED)],
                         ids=_ids([m for m in MATRIX if not m[0].startswith(REPLICATED)]))
def test_metadata_layout_matches_live_pieces_on_both_sides(refits, pair, case):
    train, gen = refits(pair)
    assert all(rank[case]["metadata_layout_equal"] for rank in train + gen)


def test_fp32_master_weights_refit_into_bf16_destination_by_sender_cast(refits):
    """FSDP2 trainer with a bf16 MixedPrecisionPolicy (sharded fp32 masters) -> bf16 TP policy:
    bitwise equal to the reference rounded to bf16, both steps."""
    train, gen = refits("fsdp2-to-tp2")
    case = "tiny-llama:bfloat16"
    assert all(rank[case]["source_equal_2"] for rank in train)
    for result in gen:
        for step in (1, 2):
            assert result[case][f"params_mismatch_{step}"] == []
            assert result[case][f"pieces_mismatch_{step}"] == []
    assert train[0][case]["sent_bytes_1"] * 2 == train[0]["tiny-llama:float32"]["sent_bytes_1"]


def test_tp_split_tied_embeddings_stay_in_sync_on_the_destination(refits):
    """A destination whose TP plan split the tied lm_head from embed_tokens: the checkpoint has no
    lm_head; refit_finish_update copies embed_tokens into it (lm_head checked bitwise, and the
    sharded model's own logits)."""
    _, gen = refits("fsdp2-to-tp2")
    case = "tiny-qwen3-tied:float32:tied-embeddings-tp-sharded"
    for result in gen:
        for step in (1, 2):
            assert result[case][f"params_mismatch_{step}"] == []
            assert result[case][f"logits_{step}"]["own_forward_close"]


@pytest.mark.parametrize("pair", ["fsdp2-to-tp2", "tp2-to-2d", "2d-to-fsdp2", "replicated2-to-fsdp2"])
def test_a_replaced_parameter_is_named_and_a_forward_is_not_a_move(refits, pair):
    """The dtensor plugin lists each parameter's local tensor (``refit_model_tensors``), so refit checks the
    model's own tensors before every step: a forward since setup (FSDP2 keeps the root's all-gathered copies
    until it reshards) passes, a parameter replaced by a copy is named on every train rank."""
    train, _ = refits(pair)
    for rank in train:
        moves = rank[next(iter(rank))]["moves"]
        assert moves["lists"] and moves["after_forward"] is None, moves
        assert f"source tensor {moves['replaced']} now lives at a different address" in moves["after_replace"]


def test_replicated_sources_share_the_work(refits):
    """Two plain (non-DTensor) replicas of the whole model: the planner splits the sends."""
    train, _ = refits("replicated2-to-fsdp2")
    sent = [rank["tiny-llama:float32"]["sent_bytes_1"] for rank in train]
    assert min(sent) > 0 and max(sent) < 0.75 * sum(sent), sent


def test_mismatched_config_fails_at_setup_naming_the_first_mismatching_tensors(refits):
    """FSDP2 train ranks with a stock tiny Llama, TP gen ranks with another ``intermediate_size``."""
    train, gen = refits(MISMATCH[0])
    for kind, message in (rank["mismatch"] for rank in train + gen):  # every rank fails with the same cause
        assert kind == "PlanError", message
        assert "shape mismatch" in message
        assert "model.layers.0.mlp.gate_proj.weight: source (256, 128) vs destination (192, 128)" in message
