"""The algorithm object (algo/algorithm.py): what each method asks of a step, with hand-computed values."""

import dataclasses

import pytest
import torch

from hacrl_megatron.algo import StepPasses, build_algorithm
from hacrl_megatron.algo.algorithm import METHODS
from hacrl_megatron.config import ALGORITHMS, HACPOConfig


def algo(n=2, **fields):
    return build_algorithm(dataclasses.replace(HACPOConfig(), **fields), n)


def test_every_configurable_method_has_an_algorithm():
    assert sorted(METHODS) == sorted(ALGORITHMS)
    with pytest.raises(ValueError, match="hacpo.algorithm='ppo'"):
        algo(algorithm="ppo")


@pytest.mark.parametrize("name, g, sources_of_1, passes", [
    ("hacpo", 4, [0, 1, 2], StepPasses()),
    ("naive", 4, [0, 1, 2], StepPasses()),
    ("gspo", 4, [1], StepPasses()),
    ("gspo_x2", 8, [1], StepPasses()),
    ("grpo", 4, [1], StepPasses(source_token_logps=True)),
])
def test_what_each_method_asks_of_a_step(name, g, sources_of_1, passes):
    a = algo(3, algorithm=name)
    assert a.name == name
    assert a.samples_per_prompt(4) == g
    assert a.sources(1) == sources_of_1
    assert a.passes == passes


def test_only_the_decoupled_cross_term_needs_the_learners_old_pass_on_others():
    for mode in ("clamp", "pessimistic", "gspo"):
        assert algo(cross_clip_mode=mode).passes == StepPasses()
    assert algo(cross_clip_mode="decoupled").passes == StepPasses(learner_old_on_others=True)
    # the switch belongs to HACPO's cross term: a method without one never asks for the pass
    assert algo(algorithm="naive", cross_clip_mode="decoupled").passes == StepPasses()


def test_advantages_by_hand():
    # one prompt, 2 agents, G = 2: agent 0 rewards (1, 0), agent 1 rewards (1, 1); ω^(0,1) = 2 (clipped ratio)
    rewards = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    omega = torch.tensor([[1.0, 2.0], [0.5, 1.0]], dtype=torch.float64)
    # HACPO, learner 0: μ = (1 + 0 + 2·1 + 2·1)/4 = 1.25 > max_reward 1 → baseline guard: own mean 0.5.
    # σ over the raw 4 rewards (1, 0, 1, 1): mean 0.75, unbiased var = (3·0.0625 + 0.5625)/3 = 0.25 → σ = 0.5
    hacpo = algo().advantages(rewards, 0, omega)
    torch.testing.assert_close(hacpo, torch.tensor([[[1.0, -1.0], [1.0, 1.0]]]))
    # Naive: plain mean 0.75 of the pool, same σ
    naive = algo(algorithm="naive").advantages(rewards, 0, omega)
    torch.testing.assert_close(naive, torch.tensor([[[0.5, -1.5], [0.5, 0.5]]]))
    # GSPO, learner 0: its own two rewards (1, 0): mean 0.5, σ = sqrt(0.5) → ±0.5/0.7071
    own = 0.5 / 0.5 ** 0.5
    gspo = algo(algorithm="gspo").advantages(rewards, 0, omega)
    torch.testing.assert_close(gspo, torch.tensor([[[own, -own]]]))


def test_grpo_loss_names_what_is_missing():
    loss = algo(algorithm="grpo").loss_fn(["a", "b"])
    with pytest.raises(ValueError, match="loss_inputs"):
        loss(None, None, None)
