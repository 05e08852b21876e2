"""The RL loop's FSDP2 policy actor scores rollouts without training: ``score`` is what the fleet loop checks every
replica's greedy generation against (``refit demo --loop --replicas N``)."""

import torch

from refit_core.kit.launch import free_port
from refit_core.kit.models import PRESETS, reference_state_dict
from refit_core.kit.rl import Rollout, completion_logprobs


def test_score_names_hf_greedy_generation_and_its_logprobs_without_an_update():
    from refit_dtensor.parallel import build_model
    from refit_dtensor.policy import FSDPPolicyActor

    config = dict(PRESETS["tiny-qwen3"])
    hf = build_model(config, dtype=torch.float32)
    hf.load_state_dict(reference_state_dict(config, 0, 0))  # the actor's initial weights
    prompt = (1, 2, 3, 4, 5)
    ids = torch.tensor([prompt])
    generated = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                            min_new_tokens=8, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    actor = FSDPPolicyActor(0, 1, config, seed=0, lr=1e-2)
    actor.init_training(f"127.0.0.1:{free_port()}")
    try:
        swapped = [*generated[:3], (generated[3] + 1) % config["vocab_size"], *generated[4:]]
        rollouts = [Rollout(0, prompt, tuple(generated), ()), Rollout(1, prompt, tuple(swapped), ())]
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        scores = actor.score(rollouts)
        assert all(torch.equal(p, before[n]) for n, p in actor.model.named_parameters())  # no update
        assert scores["greedy"][0] == generated  # HF's greedy generation, token for token
        assert scores["greedy"][1][:4] == generated[:4] and scores["greedy"][1][3] != swapped[3]
        with torch.no_grad():
            sequence = torch.tensor([prompt + tuple(generated)])
            want = completion_logprobs(hf(input_ids=sequence).logits[0], sequence[0], len(prompt))
        assert torch.allclose(torch.tensor(scores["logprobs"][0]), want, atol=1e-5)
    finally:
        actor.shutdown()
