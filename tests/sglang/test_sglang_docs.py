"""The "after" blocks of docs/migration/sglang.md (harness ``sglang-trainer``), run by 2 FSDP2 train
ranks into one SGLang TP worker: SGLang's real model class and weight-update session with refit's
custom loader (``docs_ranks.py`` says what the blocks' namespace holds). After each block the
worker's parameters must equal, bit for bit, what SGLang's own ``load_weights`` makes of the last
step's weights; the colocated block's steps move every byte straight out of the trainers' memory
(shared memory on CPU, where GPUs use CUDA IPC).
"""

from __future__ import annotations

import multiprocessing as mp

from tests.docs.docs_snippets import ROOT, harness_snippets
from tests.environments import require

require("sglang")

from docs_ranks import STEPS_PER_BLOCK, docs_ranks

from refit_core.kit.launch import free_port, spawn

PAGE = ROOT / "docs" / "migration" / "sglang.md"
TRAIN_WORLD, TP = 2, 1


def test_migration_guide_after_blocks_refit_sglang_bitwise() -> None:
    blocks = [{"code": s.code, "where": s.where} for s in harness_snippets(PAGE, "sglang-trainer")]
    assert len(blocks) == 2, f"{PAGE.name}: expected the two after blocks, found {len(blocks)}"
    pipes = [mp.get_context("spawn").Pipe() for _ in range(TP)]
    results = spawn(docs_ranks, TRAIN_WORLD + TP, TRAIN_WORLD, [free_port(), free_port()],
                    [free_port() for _ in blocks], blocks, pipes, timeout_s=300)
    train, gen = results[:TRAIN_WORLD], results[TRAIN_WORLD:]
    assert all(r["trained"] == [1, 2, 3, 4] for r in train), [r["trained"] for r in train]
    assert all(m for m in train[0]["before"]), "the engine held the first step's weights before any refit"
    assert train[0]["checks"] == [(2, [[]] * TP), (4, [[]] * TP)], train[0]["checks"]
    for rank in train:  # the first block sends over the network, the colocated one straight from memory
        network, colocated = rank["sent"]
        assert len(network) == STEPS_PER_BLOCK and all(staged > 0 and direct == 0 for staged, direct in network)
        assert len(colocated) == STEPS_PER_BLOCK and all(staged == 0 and direct > 0 for staged, direct in colocated)
    for worker in gen:
        assert worker["errors"] == [None] * 2 * STEPS_PER_BLOCK, worker["errors"]
        assert worker["versions"] == [str(s) for s in range(STEPS_PER_BLOCK)] * 2
        assert worker["flushes"] == 2 * STEPS_PER_BLOCK
