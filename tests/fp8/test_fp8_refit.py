"""FP8 destinations, end to end over gloo: every FP8 weight and scale bitwise equal to the reference
quantizer's, quantized on the sender where transfers hold whole blocks and on the receiver where
they split blocks; dense and MoE; FP8 -> FP8 as bytes; BF16 tensors (norms, router, embeddings)
stay BF16 in the same step."""

from __future__ import annotations

import pytest
from fp8_ranks import fp8_refit_rank

from refit_core.kit.launch import free_port, spawn

BF16 = {"dtype": "bfloat16"}


def run(model: str, *, train_tp: int = 1, gen_tp: int = 1, block=(32, 32), **job):
    job = {"model": model, "train_tp": train_tp, "gen_tp": gen_tp, "block": block, "config": BF16, **job}
    return spawn(fp8_refit_rank, train_tp + gen_tp, f"127.0.0.1:{free_port()}", job, timeout_s=240)


def _gen(results):
    return [r for r in results if r.get("side") == "gen"]


def test_sender_side_quantization_when_every_transfer_holds_whole_blocks():
    """32 x 32 blocks: Megatron's per-group QKV rows (64 q rows, 32 k/v rows per group) are whole blocks.
    Every tensor in messages of its own (as large ones are): the FP8 values and their scales land straight
    in the engine's weights and scales, nothing staged."""
    results = run("tiny-llama", options={"messages": {"direct_min_bytes": 0}})
    gen = _gen(results)
    assert gen and all(r["mismatches"] == [] and r["version"] == 1 for r in gen)
    assert all(r["direct"] == r["received"] > 0 for r in gen), [(r["direct"], r["received"]) for r in gen]
    assert all(r["receiver_quantized"] == [] for r in gen)
    sent = results[0]["sender_quantized"]
    assert {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight",
            "mlp.down_proj.weight"} <= set(sent)


def test_receiver_side_quantization_where_transfers_split_blocks():
    """128 x 128 blocks over 64-row query groups: q/k/v arrive in BF16 and are quantized on the gen
    rank; o_proj and the MLP still quantize on the sender, in the same step."""
    results = run("tiny-llama", block=(128, 128))
    gen = _gen(results)
    assert all(r["mismatches"] == [] for r in gen)
    received = set(gen[0]["receiver_quantized"])
    sent = set(results[0]["sender_quantized"])
    assert {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"} <= received
    assert {"self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight"} <= sent
    assert not received & sent


@pytest.mark.parametrize("train_tp,gen_tp,block", [(2, 1, (32, 32)), (2, 1, (128, 128)), (1, 2, (32, 32))])
def test_moe_resharded_bitwise(train_tp, gen_tp, block):
    """Qwen3-MoE experts (stacked w13 / w2 scales per expert), TP 2 -> 1 (column shards of o_proj and
    down_proj meet whole destination blocks only for small blocks) and TP 1 -> 2."""
    results = run("tiny-qwen3-moe", train_tp=train_tp, gen_tp=gen_tp, block=block)
    gen = _gen(results)
    assert gen and all(r["mismatches"] == [] and r["version"] == 1 for r in gen)
    sent = {n for r in results for n in r["sender_quantized"]}
    assert any("experts" in n for n in sent) or any("experts" in n for r in gen for n in r["receiver_quantized"])
    if block == (128, 128):
        assert any("o_proj" in n for r in gen for n in r["receiver_quantized"])


def test_small_buckets_cut_messages_on_block_boundaries():
    """A 16 KiB bucket forces quantized transfers into many block-aligned messages."""
    results = run("tiny-qwen3-moe", bucket_bytes=16 << 10)
    assert all(r["mismatches"] == [] for r in _gen(results))


def test_fp8_source_moves_values_and_scales_as_bytes():
    """A trainer that already holds block-FP8 weights and scales: nothing is quantized again."""
    results = run("tiny-qwen3-moe", source_block=(32, 32))
    gen = _gen(results)
    assert all(r["mismatches"] == [] for r in gen)
    assert results[0]["sender_quantized"] == [] and gen[0]["receiver_quantized"] == []


def test_fp8_moves_about_half_the_bytes_of_bf16():
    fp8 = run("tiny-llama", steps=1, config={"dtype": "bfloat16", "vocab_size": 128})
    bf16 = run("tiny-llama", steps=1, block=None, config={"dtype": "bfloat16", "vocab_size": 128})
    ratio = fp8[0]["bytes"] / bf16[0]["bytes"]
    assert 0.5 < ratio < 0.6, ratio


def test_mismatched_quantization_fails_at_setup_on_every_rank():
    """A trainer holding 32 x 32 block-FP8 into an engine that wants 64 x 64 blocks: no silent requantization."""
    results = run("tiny-llama", block=(64, 64), source_block=(32, 32))
    assert all("error" in r for r in results)
    assert all("FP8 dtype problem" in r["error"] and "blocks (1, 32, 32)" not in r["error"]
               and "blocks (32, 32)" in r["error"] and "blocks (64, 64)" in r["error"] for r in results)


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_colocated_pairs_quantize_from_the_trainers_memory(block):
    """``colocate=shared``: the CPU pair reads the trainer's memory (no messages); the segments the plan
    quantizes on the sender are quantized by the gen rank straight from it, the others on the receiver
    after the copies, every weight and scale bitwise equal to the reference quantizer's."""
    results = run("tiny-llama", block=block, options={"colocate": "shared"})
    gen = _gen(results)
    assert gen and all(r["mismatches"] == [] and r["version"] == 1 for r in gen), results
    assert results[0]["sender_quantized"]


@pytest.mark.parametrize("broadcast", [False, True], ids=["chain", "broadcast"])
def test_relayed_replicas_get_the_quantized_bytes_and_quantize_the_rest_themselves(broadcast: bool):
    """TP 2 -> 3 replicas of TP 1, a chain fed by the trainers through replica 0 (or the trainers' broadcasts),
    128 x 128 blocks: what the trainers quantize (the MLP) is relayed as FP8 values and scales; what the
    receivers quantize (q/k/v, whose shards split blocks) is relayed in BF16 and every replica quantizes it
    itself. Every replica bitwise."""
    job = {"model": "tiny-llama", "train_tp": 2, "gen_tp": 1, "block": (128, 128), "config": BF16,
           "options": {"relay": {"replicas": 3, "direct": 1, "broadcast": broadcast}}}
    results = spawn(fp8_refit_rank, 5, f"127.0.0.1:{free_port()}", job, timeout_s=240)
    assert not [r["error"] for r in results if "error" in r], results
    gen = _gen(results)
    assert len(gen) == 3 and all(r["mismatches"] == [] and r["version"] == 1 for r in gen)
    assert all(set(r["receiver_quantized"]) >= {"self_attn.q_proj.weight"} for r in gen)
    sent = {n for r in results for n in r["sender_quantized"]}
    assert {"mlp.down_proj.weight"} <= sent and not sent & set(gen[2]["receiver_quantized"])
