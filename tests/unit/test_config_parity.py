"""The reference-code parity switches in the config: values, rules and the paper presets' choices."""

import pytest

from hacrl_megatron.config import ConfigError, ExperimentConfig, from_dict, load_config
from hacrl_megatron.config.loading import read_preset


@pytest.mark.parametrize("override, fragment", [
    ("hacpo.kl_coef=-0.1", "hacpo.kl_coef=-0.1: must be a finite number >= 0"),
    ("hacpo.kl_coef=.nan", "hacpo.kl_coef=nan: must be a finite number >= 0"),
    ("hacpo.kl_coef=.inf", "hacpo.kl_coef=inf: must be a finite number >= 0"),
    ("hacpo.kl_estimator=k3", "hacpo.kl_estimator='k3': must be one of"),
    ("train.minibatch_order=random", "train.minibatch_order='random': must be one of"),
    ("rollout.eos_mode=strip", "rollout.eos_mode='strip': must be one of"),
])
def test_bad_parity_values_name_the_field(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", [override])
    assert fragment in str(err.value)


def test_naive_merge_shares_rollouts_and_needs_two_agents():
    assert load_config("cpu_demo", ["hacpo.algorithm=naive_merge"]).hacpo.algorithm == "naive_merge"
    with pytest.raises(ConfigError, match="needs >= 2 agents"):
        load_config("cpu_demo", ["hacpo.algorithm=naive_merge", "agents=[{name: solo}]"])


def test_cpu_demo_keeps_the_package_defaults():
    exp = load_config("cpu_demo")
    assert (exp.hacpo.kl_coef, exp.rollout.eos_mode, exp.train.minibatch_order) == (0.0, "learner_eos", "shuffle")


@pytest.mark.parametrize("preset", ["paper_qwen3_4b_with_instruct", "paper_qwen3_1p7b_with_4b_base",
                                    "paper_qwen3_4b_base_with_llama3p2_3b"])
def test_paper_presets_take_the_reference_codes_values(preset):
    exp = from_dict(ExperimentConfig, read_preset(preset))  # unvalidated: the model folders exist on clusters only
    assert (exp.hacpo.kl_coef, exp.hacpo.kl_estimator) == (1e-3, "low_var_kl")
    assert exp.rollout.eos_mode == "strip_all"
    assert exp.train.minibatch_order == "self_first"


def test_exponent_literals_without_a_dot_are_numbers():
    """YAML 1.1 reads ``1e-3`` as a string; a float field takes it as the number it spells."""
    assert load_config("cpu_demo", ["hacpo.kl_coef=1e-3"]).hacpo.kl_coef == 1e-3
    assert load_config("cpu_demo", ["agents.0.lr=3E-4"]).agents[0].lr == 3e-4
    with pytest.raises(ConfigError, match="hacpo.kl_coef: expected a number, got '1e-3x'"):
        load_config("cpu_demo", ["hacpo.kl_coef=1e-3x"])
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_config("cpu_demo", ["train.steps=1e3"])  # integers stay integers
