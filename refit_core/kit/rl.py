"""The small, backend-free pieces of an RL loop around refit: rollouts, a checkable reward, GRPO
advantages and the trainer-vs-engine log-probability mismatch ("generation KL").

``refit demo --loop`` (:mod:`refit_core.tools.demo.rl_loop`) uses them between a train backend's policy
actor and a gen backend's engine actor; they are plain Python and torch, so any loop can reuse them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rollout:
    """One sampled completion: the prompt's index and tokens, the sampled tokens, the engine's
    log-probability of each sampled token, and the weight version(s) that produced them."""

    prompt_index: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[str, ...] = ()


@dataclass(frozen=True)
class TargetSetReward:
    """Reward = the fraction of completion tokens that fall in a target set of token ids
    (``token % modulus == 0``): synthetic, cheap and checkable (a random policy scores ``1/modulus``)."""

    modulus: int = 8

    def __call__(self, tokens: Sequence[int]) -> float:
        return sum(1 for t in tokens if t % self.modulus == 0) / max(1, len(tokens))

    @property
    def chance(self) -> float:
        """The expected reward of a uniformly random policy."""
        return 1.0 / self.modulus


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-4) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation.

    Rewards come in consecutive groups of ``group_size`` samples of the same prompt.
    """
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def completion_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probabilities of ``tokens[prompt_len:]`` under ``logits`` (``[T, V]`` for one sequence)."""
    predicted = logits[prompt_len - 1:-1].float().log_softmax(-1)
    return predicted.gather(-1, tokens[prompt_len:].unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class LogprobMismatch:
    """How far the engine's log-probabilities of the sampled tokens are from the trainer's.

    ``kl`` is the k3 estimator of KL(engine || trainer) averaged over tokens (~0 when the engine
    holds exactly the trainer's weights); ``max_abs`` the largest per-token difference.
    """

    kl: float
    max_abs: float
    tokens: int


def logprob_mismatch(engine: Sequence[float], trainer: Sequence[float]) -> LogprobMismatch:
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine log-probabilities vs {len(trainer)} trainer ones")
    if not engine:
        return LogprobMismatch(0.0, 0.0, 0)
    e = torch.tensor(engine, dtype=torch.float64)
    t = torch.tensor(trainer, dtype=torch.float64)
    ratio = t - e  # log(pi_trainer / pi_engine) at tokens sampled from the engine
    kl = (ratio.exp() - ratio - 1).mean().item()
    return LogprobMismatch(kl, (t - e).abs().max().item(), len(engine))


__all__ = ["LogprobMismatch", "Rollout", "TargetSetReward", "completion_logprobs", "group_advantages",
           "logprob_mismatch"]
