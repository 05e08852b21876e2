"""The RL loop's pure pieces: reward, GRPO advantages, log-probabilities and their mismatch."""

from __future__ import annotations

import math

import pytest
import torch

from refit_core.kit.rl import TargetSetReward, completion_logprobs, group_advantages, logprob_mismatch


def test_target_set_reward_counts_tokens_in_the_set() -> None:
    reward = TargetSetReward(modulus=4)
    assert reward([0, 4, 5, 7]) == 0.5
    assert reward([]) == 0.0
    assert reward.chance == 0.25


def test_group_advantages_are_normalized_within_each_group() -> None:
    adv = group_advantages([1.0, 0.0, 0.5, 0.5], group_size=2)
    assert adv[0] == pytest.approx(1.0, abs=1e-3) and adv[1] == pytest.approx(-1.0, abs=1e-3)
    assert adv[2:] == [0.0, 0.0]  # a group with one reward for all learns nothing
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 0.0], group_size=3)


def test_completion_logprobs_score_the_tokens_after_the_prompt() -> None:
    logits = torch.randn(5, 7)
    tokens = torch.tensor([1, 2, 3, 4, 5])
    got = completion_logprobs(logits, tokens, prompt_len=3)
    want = torch.stack([logits[i].log_softmax(-1)[tokens[i + 1]] for i in (2, 3)])
    assert torch.equal(got, want)


def test_logprob_mismatch_is_zero_for_equal_and_large_for_stale_weights() -> None:
    same = logprob_mismatch([-1.0, -2.0], [-1.0, -2.0])
    assert same.kl == 0.0 and same.max_abs == 0.0 and same.tokens == 2
    stale = logprob_mismatch([-1.0, -2.0], [-1.5, -1.2])  # the trainer moved, the engine did not
    assert stale.kl > 1e-2 and stale.max_abs == pytest.approx(0.8)
    r = torch.tensor([-0.5, 0.8], dtype=torch.float64)
    assert math.isclose(stale.kl, (r.exp() - r - 1).mean().item())
    with pytest.raises(ValueError, match="2 engine"):
        logprob_mismatch([-1.0, -2.0], [-1.0])
