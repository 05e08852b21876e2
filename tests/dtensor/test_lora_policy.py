"""The RL loop's FSDP2 policy actor with ``lora``: only the adapter trains, GRPO steps raise the
probability of rewarded tokens, and the model it refits is the PEFT model in the spec's mode."""

import torch

from tests.environments import require

from refit_core import LoraSpec, get_plugin_manager
from refit_core.kit.launch import free_port
from refit_core.kit.models import PRESETS
from refit_core.kit.rl import Rollout, TargetSetReward, group_advantages
from refit_core.tools.demo.rl_loop import LORA_LR, LoopSettings, lora_bytes_line, loop_lora

require("peft")


def test_lora_policy_trains_only_the_adapter_and_learns_the_reward():
    from refit_dtensor.lora import Merged
    from refit_dtensor.policy import FSDPPolicyActor

    config = dict(PRESETS["tiny-qwen3"])
    lora = loop_lora("r=4,targets=q,v,o,down")
    actor = FSDPPolicyActor(0, 1, config, seed=0, lr=LORA_LR, lora=lora)
    trained = actor.init_training(f"127.0.0.1:{free_port()}")
    try:
        assert actor.adapter_bytes() == trained * 4 > 0  # fp32 A and B only
        frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters() if ".lora_" not in n}
        reward = TargetSetReward()
        generator = torch.Generator().manual_seed(0)
        prompt = tuple(range(1, 9))
        rollouts = [Rollout(0, prompt, tuple(torch.randint(0, 512, (8,), generator=generator).tolist()), ())
                    for _ in range(8)]
        advantages = group_advantages([reward(r.tokens) for r in rollouts], 8)
        best = max(range(8), key=lambda i: advantages[i])
        before = sum(actor.train_step(rollouts, advantages)["logprobs"][best])
        for _ in range(3):
            after = sum(actor.train_step(rollouts, advantages)["logprobs"][best])
        assert after > before + 0.1  # the best rollout's tokens got likelier
        assert all(torch.equal(p, frozen[n]) for n, p in actor.model.named_parameters() if n in frozen)
        source = actor.refit_model()
        assert isinstance(source, Merged)
        names = {p.spec.name for p in get_plugin_manager().source_pieces(source)}
        assert "model.layers.0.self_attn.q_proj.weight" in names and not any("lora" in n for n in names)
    finally:
        actor.shutdown()


def test_loop_lora_defaults_to_merged_mode_and_a_lora_learning_rate():
    assert loop_lora(None) is None
    assert loop_lora("r=8").mode.value == "merged" and loop_lora("r=8,mode=adapter").mode.value == "adapter"
    assert LoopSettings(lora=LoraSpec(rank=8, alpha=16)).learning_rate == LORA_LR
    assert LoopSettings().learning_rate == LoopSettings.lr
    line = lora_bytes_line(loop_lora("r=8"), 2048, 1024, 2048)
    assert "merged mode" in line and "100.0% of the full model's 2.0 KiB" in line and "adapter alone: 1.0 KiB" in line
