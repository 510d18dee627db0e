"""Config loading, overrides and up-front validation with messages naming field, value and rule."""

import pytest
import yaml

from hacrl_megatron.config import (
    ConfigError,
    ExperimentConfig,
    apply_override,
    from_dict,
    load_config,
    preset_names,
    validate,
)


def test_every_builtin_preset_loads_and_validates():
    names = preset_names()
    assert "cpu_demo" in names
    for name in names:
        cfg = load_config(name)
        assert isinstance(cfg, ExperimentConfig)
        assert len(cfg.agents) >= 1


def test_dotted_overrides_reach_nested_fields_and_list_items():
    cfg = load_config("cpu_demo", ["hacpo.alpha=3", "agents.0.parallel.tp=2", "agents.0.model.num_heads=4",
                                   "agents.0.model.num_kv_heads=2", "train.steps=7", "data.eval_benchmarks=[gsm8k, math500]"])
    assert cfg.hacpo.alpha == 3.0 and isinstance(cfg.hacpo.alpha, float)
    assert cfg.agents[0].parallel.tp == 2
    assert cfg.train.steps == 7
    assert cfg.data.eval_benchmarks == ["gsm8k", "math500"]


def test_preset_from_path_with_base(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"base": "cpu_demo", "train": {"steps": 3}, "hacpo": {"alpha": 0.0}}))
    cfg = load_config(str(path))
    assert cfg.train.steps == 3 and cfg.hacpo.alpha == 0.0
    assert cfg.agents == load_config("cpu_demo").agents


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("hacpo.alpah=1", "unknown key(s) ['alpah']"),
        ("train.steps=abc", "train.steps: expected an integer, got 'abc'"),
        ("train.steps=1.5", "train.steps: expected an integer"),
        ("hacpo.stepwise=3", "hacpo.stepwise: expected true/false"),
        ("hacpo.alpha=-1", "hacpo.alpha=-1.0: must be >= 0"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt=1: G must be >= 2"),
        ("hacpo.omega_min=2", "clip bounds out of order"),
        ("hacpo.cross_clip_low=1.5", "hacpo.cross_clip_low=1.5"),
        ("agents.1.name=llama", "agents.1.name='llama': duplicate agent name"),
        ("agents.0.parallel.tp=3", "agents.0.parallel.tp=3: must divide num_heads=4"),
        ("agents.0.parallel.pp=5", "agents.0.parallel.pp=5: pp=5 cannot split num_layers=4"),
        ("hacpo.algorithm=ppo", "hacpo.algorithm='ppo': must be one of"),
        ("train.mini_batches=3", "must divide train.prompts_per_step"),
        ("agents.5.lr=1", "index '5' out of range"),
        ("noequals", "expected dotted.key=value"),
        ("agents.0.name=a-b", "must be an identifier"),
        ("agents.0.workers=local", None),
        ("agents.0.workers=threads", "agents.0.workers='threads': must be one of"),
    ],
)
def test_bad_values_fail_before_work_with_named_field(override, fragment):
    if fragment is None:  # valid alone: checked with its partner below
        load_config("cpu_demo", [override])
        return
    with pytest.raises(ConfigError) as err:
        load_config("cpu_demo", [override])
    assert fragment in str(err.value)


def test_local_workers_cannot_hold_a_parallel_layout():
    with pytest.raises(ConfigError, match="needs its own world: set workers: ray or auto"):
        load_config("cpu_demo", ["agents.0.workers=local", "agents.0.parallel.tp=2"])
    with pytest.raises(ConfigError, match="Ray worker groups run Megatron agents"):
        load_config("cpu_demo", ["agents.0.workers=ray", "agents.0.backend=hf"])


def test_hacpo_needs_two_agents_but_gspo_runs_alone():
    with pytest.raises(ConfigError, match="needs >= 2 agents"):
        validate(from_dict(ExperimentConfig, {"agents": [{"name": "solo"}]}))
    cfg = validate(from_dict(ExperimentConfig, {"agents": [{"name": "solo"}], "hacpo": {"algorithm": "gspo"}}))
    assert cfg.hacpo.algorithm == "gspo"


def test_missing_preset_lists_builtins():
    with pytest.raises(ConfigError, match="cpu_demo"):
        load_config("does_not_exist")


def test_apply_override_creates_nested_mapping():
    data: dict = {}
    apply_override(data, "log.wandb=true")
    assert data == {"log": {"wandb": True}}
