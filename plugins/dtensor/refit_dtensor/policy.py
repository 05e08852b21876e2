"""An FSDP2 policy as a Ray train actor: the trainer side of ``refit demo --loop``.

One actor per rank; the ranks form their own gloo (CPU) or NCCL (CUDA) process group, shard a
``transformers`` causal LM with FSDP2 (fp32 master weights), and take GRPO steps with AdamW on the
rollouts the controller hands them. The actor is a :class:`refit_core.apps.RefitTrainActor`, so
:class:`refit_core.apps.RayRefit` sends its shards to the engine after every step, in place.

With ``lora`` (a :class:`~refit_core.LoraSpec`) the policy is a PEFT LoRA model whose base weights stay
frozen; it refits in the spec's mode (merged: the engine gets ``W + scale * B @ A`` as plain weights;
adapter: only the adapters move, into an engine's LoRA slots).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from refit_core import LoraMode, LoraSpec, ParallelLayout
from refit_core.apps import RefitTrainActor, Rollout, completion_logprobs, reference_state_dict

from .parallel import build_model, init_mesh, shard_model
from .shards import load_hf_weights


class FSDPPolicyActor(RefitTrainActor):
    """Train rank ``rank`` of ``world_size``: a policy sharded with FSDP2 and its AdamW optimizer.

    The initial weights are ``reference_state_dict(config, seed, 0)``, identical on every rank.
    """

    def __init__(self, rank: int, world_size: int, config: dict[str, Any], *, seed: int, lr: float,
                 device: str = "cpu", lora: LoraSpec | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.config, self.seed, self.lr, self.device = config, seed, lr, device
        self.lora = lora
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def init_training(self, dist_address: str) -> int:
        """Join the trainers' process group at ``dist_address`` (``host:port``, e.g. train rank 0's
        :meth:`refit_address`), build and shard the policy (collective over the trainers); returns
        the number of parameters."""
        torch.set_num_threads(1)
        device = torch.device(self.device)
        if device.type == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{dist_address}", rank=self.rank,
                                world_size=self.world_size)
        layout = ParallelLayout(fsdp=self.world_size)
        model = build_model(self.config, dtype=torch.float32, device=device)
        load_hf_weights(model, reference_state_dict(self.config, self.seed, 0))
        policy = model if self.lora is None else _with_lora(model, self.lora, self.seed)
        shard_model(model, layout, init_mesh(layout, device.type))  # the PEFT layers live inside ``model``
        self.model = policy.train()
        trained = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=self.lr, betas=(0.9, 0.99), weight_decay=0.0)
        return sum(p.numel() for p in trained)

    def refit_model(self) -> Any:
        if self.lora is not None and self.lora.mode is LoraMode.MERGED:
            from .lora import merged
            return merged(self.model)
        return self.model

    def adapter_bytes(self) -> int:
        """The bytes of the LoRA adapter (A and B of every adapted module; 0 without LoRA)."""
        return sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if ".lora_" in n)

    def train_step(self, rollouts: list[Rollout], advantages: list[float]) -> dict[str, Any]:
        """One GRPO step on this rank's share of the batch (every ``world_size``-th rollout).

        Returns this rank's rollout indices, the policy's log-probabilities of their sampled tokens
        *before* the update (the weights the engine sampled with) and the loss.
        """
        mine = list(range(self.rank, len(rollouts), self.world_size))
        logits, logprobs = self._forward([rollouts[i] for i in mine])
        adv = torch.tensor([advantages[i] for i in mine], dtype=torch.float32, device=logprobs.device)
        loss = -(adv.unsqueeze(1) * logprobs).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return {"indices": mine, "logprobs": logprobs.detach().cpu().tolist(), "loss": loss.item()}

    def score(self, rollouts: list[Rollout]) -> dict[str, Any]:
        """Every rollout (prompts of one length, completions of one length) under the policy as it is now, no
        update; every rank scores them all (FSDP's forward is collective). Returns the log-probabilities of their
        tokens and the policy's greedy choice at each position, fed the rollout's tokens before it: equal to
        the rollout's tokens exactly when HF's greedy generation from its prompt is the rollout."""
        with torch.no_grad():
            logits, logprobs = self._forward(rollouts)
        prompt_len = len(rollouts[0].prompt)
        greedy = logits[:, prompt_len - 1:-1].argmax(-1)
        return {"logprobs": logprobs.cpu().tolist(), "greedy": greedy.cpu().tolist()}

    def _forward(self, rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's logits of ``rollouts`` (prompt + completion) and its log-probabilities of their tokens."""
        device = next(self.model.parameters()).device
        sequences = torch.tensor([r.prompt + r.tokens for r in rollouts], device=device)
        prompt_len = len(rollouts[0].prompt)
        logits = self.model(input_ids=sequences).logits
        logprobs = torch.stack([completion_logprobs(logits[b], sequences[b], prompt_len)
                                for b in range(len(rollouts))])
        return logits, logprobs

    def shutdown(self) -> None:
        self.refit_close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _with_lora(model: torch.nn.Module, lora: LoraSpec, seed: int) -> Any:
    """``model`` wrapped by PEFT with ``lora``'s rank, alpha and targets (A random, B zero: PEFT's init)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                                            lora_dropout=0.0))


__all__ = ["FSDPPolicyActor"]
