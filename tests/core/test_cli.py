"""The command line: plan from metadata alone, and clear errors for bad input."""

import subprocess
import sys


def refit(*args):
    return subprocess.run([sys.executable, "-m", "refit_core", *args], capture_output=True, text=True, timeout=120)


def test_plan_prints_the_summary_from_metadata_alone():
    out = refit("plan", "--model", "tiny-llama", "--train", "toy:dp=2", "--gen", "toy:dp=3", "--bucket-mb", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for field in ("ranks:        2 train -> 3 gen", "bytes:", "messages:", "busiest:", "planned in:"):
        assert field in text
    # toy: 32.4 KiB reaches each gen rank's replicated qkv+norm, columns and experts
    assert "32.4 KiB" in text


def test_plan_rejects_unknown_layout_keys_and_backends():
    out = refit("plan", "--model", "tiny-llama", "--train", "toy:zz=2", "--gen", "toy")
    assert out.returncode == 2 and "layout item 'zz=2': expected KEY=N" in out.stderr
    out = refit("plan", "--model", "tiny-llama", "--train", "nope:tp=2", "--gen", "toy")
    assert out.returncode == 2 and "no installed plugin provides a train backend named 'nope'" in out.stderr


def test_unknown_model_is_a_clear_error():
    out = refit("plan", "--model", "no-such-model", "--train", "toy", "--gen", "toy")
    assert out.returncode == 2 and "neither a preset" in out.stderr


def test_plan_allows_unused_sources_only_when_asked(tmp_path):
    """DeepSeek-V3's MTP layer lives in the trainer but not in vLLM's main model: a named error,
    unless ``--allow-unused-sources`` says to plan without it."""
    import json

    from refit_core.kit.models import PRESETS

    config = dict(PRESETS["deepseek-v3-shape"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = ("plan", "--model", str(path), "--train", "megatron:tp=1", "--gen", "vllm:tp=1", "--device", "cpu")
    refused = refit(*args)
    assert refused.returncode != 0 and "model.layers.2.eh_proj.weight" in refused.stderr, refused.stderr
    assert "(pass --allow-unused-sources to skip them)" in refused.stderr, refused.stderr
    planned = refit(*args, "--allow-unused-sources")
    assert planned.returncode == 0 and "ranks:        1 train -> 1 gen" in planned.stdout, planned.stderr


def test_an_engine_layout_that_splits_heads_names_the_heads(capsys):
    from refit_core.tools.cli import main

    assert main(["plan", "--model", "tiny-llama", "--train", "dtensor:fsdp=2", "--gen", "vllm:tp=3",
                 "--device", "cpu"]) == 2
    assert "vLLM cannot split 4 attention heads over 3 ranks" in capsys.readouterr().err


def test_demo_loop_takes_the_steps_and_model_it_is_given():
    from refit_core.tools.cli import build_parser
    from refit_core.tools.demo.command import loop_settings
    from refit_core.tools.demo.rl_loop import LoopSettings

    given = loop_settings(build_parser().parse_args(["demo", "--loop", "--steps", "2", "--model", "tiny-llama"]))
    assert (given.steps, given.model) == (2, "tiny-llama")  # were 20 steps of tiny-qwen3
    default = loop_settings(build_parser().parse_args(["demo", "--loop"]))
    assert (default.steps, default.model) == (LoopSettings.steps, LoopSettings.model)
    demo = build_parser().parse_args(["demo"])
    assert demo.steps is None and demo.model is None  # cmd_demo takes DEMO_STEPS / DEMO_MODEL


def test_a_bad_topology_is_refused_before_any_planning(capsys):
    from refit_core.tools.cli import main

    assert main(["plan", "--model", "llama-3-8b-shape", "--train", "megatron:tp=8", "--gen", "vllm:tp=8",
                 "--simulate", "--topology", "gpus_per_node=eight"]) == 2
    captured = capsys.readouterr()
    assert "topology item 'gpus_per_node=eight': 'eight' is not a number" in captured.err
    assert "refit plan:" not in captured.out + captured.err  # refused before the plan's progress lines


def test_the_command_line_guide_names_every_model_preset():
    from pathlib import Path

    from refit_core.kit.models import PRESETS

    guide = (Path(__file__).parents[2] / "docs" / "guides" / "command-line.md").read_text()
    assert [name for name in PRESETS if f"`{name}`" not in guide] == []
