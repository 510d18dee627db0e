"""The rules of the large-scale layout keys (config/validation_scale.py): overlapped DDP, context
parallelism and the token budget against each agent's padded row geometry; every refusal names the
field, through the public load_config (the rules hacrl config and hacrl train apply)."""

from __future__ import annotations

import pytest

from hacrl_megatron.agents.ddp import bucket_params
from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.config.validation_scale import require_context_parallel

# cpu_demo's agents: 0 = llama (megatron), 1 = qwen3; workers auto
RAY = ["agents.0.workers=ray"]


def test_overlap_keys_reach_a_valid_config():
    cfg = load_config("cpu_demo", ["agents.0.parallel.use_distributed_optimizer=true",
                                   "agents.0.parallel.overlap_grad_reduce=true",
                                   "agents.0.parallel.overlap_param_gather=true", "agents.0.parallel.ddp_bucket_mb=64"])
    p = cfg.agents[0].parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_mb) == (True, True, 64)


@pytest.mark.parametrize("overrides, field, words", [
    (["agents.0.parallel.overlap_param_gather=true"], "agents.0.parallel.overlap_param_gather",
     "use_distributed_optimizer: true"),
    (["agents.0.parallel.use_distributed_optimizer=true", "agents.0.parallel.overlap_param_gather=true"],
     "agents.0.parallel.overlap_param_gather", "overlap_grad_reduce: true"),
    (["agents.0.parallel.ddp_bucket_mb=-1"], "agents.0.parallel.ddp_bucket_mb", ">= 0"),
    (["agents.1.backend=hf", "agents.1.parallel.overlap_grad_reduce=true"], "agents.1.parallel.overlap_grad_reduce",
     "backend: megatron"),
    (["agents.1.backend=hf", "agents.1.parallel.ddp_bucket_mb=8"], "agents.1.parallel.ddp_bucket_mb",
     "backend: megatron"),
])
def test_overlap_rules_name_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", overrides)
    assert str(err.value).startswith(field + "=") and words in str(err.value)


@pytest.mark.parametrize("overrides, words", [
    (["agents.0.parallel.cp=2", "agents.0.workers=local"], "needs its own world"),
    (["agents.0.parallel.cp=2", "agents.0.backend=hf", "agents.0.workers=local"], "needs backend: megatron"),
    (["agents.0.parallel.cp=0"], ">= 1"),
])
def test_context_parallelism_is_refused_here_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", overrides)
    assert str(err.value).startswith("agents.0.parallel.cp=") and words in str(err.value)
    assert "\n" not in str(err.value)  # one line


def test_context_parallelism_is_refused_where_the_ranks_are_built_without_transformer_engine(monkeypatch):
    """The configuration rules accept cp > 1 anywhere (a login node validates for its cluster); the machine
    that builds the ranks refuses it without Transformer Engine on CUDA, in one line naming the key."""
    assert load_config("cpu_demo", ["agents.0.parallel.cp=2", *RAY]).agents[0].parallel.cp == 2
    require_context_parallel(1, "x")  # cp = 1: nothing to check
    with pytest.raises(ConfigError, match=r"^agent 'a': parallel\.cp=4: .*Transformer Engine") as err:
        require_context_parallel(4, "agent 'a': parallel.cp")
    assert "\n" not in str(err.value)
    monkeypatch.setattr("hacrl_megatron.config.validation_scale.transformer_engine_available", lambda: True)
    require_context_parallel(2, "agents.0.parallel.cp")


def test_hacrl_train_refuses_context_parallelism_on_this_cpu_naming_the_key(tmp_path):
    """What a user on a CPU machine sees: exit 1 before any rank starts, one line naming agents.0.parallel.cp."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hacrl_megatron", "train", "--preset", "cpu_demo",
                          "agents.0.parallel.cp=2", "agents.0.workers=ray", "train.steps=1",
                          f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "agents.0.parallel.cp=2: context parallelism needs Transformer Engine" in out.stderr
    assert "Traceback" not in out.stderr


def test_context_parallelism_is_accepted_by_validation_with_transformer_engine(monkeypatch):
    """With TE (monkeypatched) a cp = 2 agent validates: its world is tp·pp·cp·dp ranks, a token budget
    must hold the longest sequence padded to a multiple of 2·cp, and routing replay is refused."""
    monkeypatch.setattr("hacrl_megatron.config.validation_scale.transformer_engine_available", lambda: True)
    cfg = load_config("cpu_demo", ["agents.0.parallel.cp=2", "agents.0.parallel.tp=2", *RAY])
    assert (cfg.agents[0].parallel.cp, cfg.agents[0].parallel.world_size) == (2, 4)
    base = load_config("cpu_demo")
    longest = base.rollout.max_prompt_len + base.rollout.max_response_len
    response = base.rollout.max_response_len + ((1 - longest) % 4 or 4)
    longest = base.rollout.max_prompt_len + response  # 1 more than a multiple of 2·cp = 4: padded by 3
    cp2 = ["agents.0.parallel.cp=2", *RAY, f"rollout.max_response_len={response}"]
    with pytest.raises(ConfigError, match=rf"^train\.max_tokens_per_microbatch={longest}: .*become {longest + 3}"):
        load_config("cpu_demo", [*cp2, f"train.max_tokens_per_microbatch={longest}"])
    load_config("cpu_demo", [*cp2, f"train.max_tokens_per_microbatch={longest + 3}"])


def test_routing_replay_is_refused_with_context_parallelism(monkeypatch):
    monkeypatch.setattr("hacrl_megatron.config.validation_scale.transformer_engine_available", lambda: True)
    moe = ["agents.0.model.arch=qwen3_moe", "agents.0.model.num_experts=4", "agents.0.model.moe_routing_replay=true"]
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", [*moe, "agents.0.parallel.cp=2", *RAY])
    assert str(err.value).startswith("agents.0.model.moe_routing_replay=") and "parallel.cp=2" in str(err.value)
    load_config("cpu_demo", [*moe, *RAY])  # without cp the same agent validates


def test_token_budget_holds_the_longest_sequence_as_the_layout_pads_it():
    """Sequence parallelism pads rows to a multiple of tp: a budget equal to the longest sequence may
    not hold it padded. cpu_demo's longest sequence: rollout.max_prompt_len + max_response_len."""
    base = load_config("cpu_demo")
    longest = base.rollout.max_prompt_len + base.rollout.max_response_len
    odd = longest | 1  # an odd budget that holds the sequence unpadded
    tp2 = [*RAY, "agents.0.parallel.tp=2", "agents.0.parallel.sequence_parallel=true"]
    if (longest % 2) == 0:  # make the longest sequence odd so that tp=2 pads it past an equal budget
        tp2 += [f"rollout.max_response_len={base.rollout.max_response_len + 1}"]
        longest, odd = longest + 1, longest + 1
    load_config("cpu_demo", [f"train.max_tokens_per_microbatch={odd}"])  # no padding: fits
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", [*tp2, f"train.max_tokens_per_microbatch={odd}"])
    message = str(err.value)
    assert message.startswith(f"train.max_tokens_per_microbatch={odd}:") and f"become {odd + 1}" in message
    assert "'llama'" in message
    load_config("cpu_demo", [*tp2, f"train.max_tokens_per_microbatch={odd + 1}"])


def test_bucket_size_in_parameters():
    assert bucket_params(0) is None  # megatron's default
    assert bucket_params(1) == 262144  # 1 MiB of fp32 gradients
    assert bucket_params(40) == 40 * 262144
    with pytest.raises(ValueError, match="ddp_bucket_mb=-3"):
        bucket_params(-3)
