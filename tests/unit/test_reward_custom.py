"""A user's checker plugged in by spec (data.checker / hacrl eval --checker): parsing, loading,
errors that name the field, and scoring through VerifierPool in-process and in worker processes."""

from __future__ import annotations

import pickle

import pytest

from hacrl_megatron.config import ConfigError, check_data_files, load_config
from hacrl_megatron.reward import RewardRequest, VerifierPool
from hacrl_megatron.reward.custom import (
    CheckerError,
    CustomScorer,
    custom_score_fn,
    load_checker,
    parse_checker_spec,
)

CHECKER = '''
def exact(response, reference):
    return 1.0 if response.strip() == reference else 0.0

def half(response, reference):
    return 0.5

def out_of_range(response, reference):
    return 2.0

def boom(response, reference):
    raise RuntimeError("checker bug")

def one_arg(response):
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture()
def checker_file(tmp_path):
    path = tmp_path / "my_checker.py"
    path.write_text(CHECKER)
    return path


def test_parse_spec_forms_and_errors():
    assert parse_checker_spec("pkg.mod:fn") == parse_checker_spec("pkg.mod:fn")
    spec = parse_checker_spec("a/b/check.py:score")
    assert (spec.target, spec.function, spec.is_file) == ("a/b/check.py", "score", True)
    assert parse_checker_spec("pkg.mod:fn").is_file is False
    for bad, why in [("nocolon", "must be"), ("pkg.mod:", "not a function name"), ("pkg-mod:fn", "neither"),
                     (":fn", "neither"), ("pkg.mod:f-n", "not a function name")]:
        with pytest.raises(CheckerError, match=why):
            parse_checker_spec(bad)


def test_load_file_and_module_checkers(checker_file, tmp_path, monkeypatch):
    assert load_checker(f"{checker_file}:exact")("7", "7") == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_checker("my_checker:half")("x", "y") == 0.5


def test_load_errors_name_field_spec_and_reason(checker_file, tmp_path):
    cases = [
        (f"{tmp_path}/missing.py:f", "no such file"),
        (f"{checker_file}:absent", r"has no 'absent'; its callables: \['boom', 'exact'"),
        (f"{checker_file}:NOT_CALLABLE", "is a int, not a function"),
        (f"{checker_file}:one_arg", "two positional arguments"),
        ("hacrl_no_such_module_xyz:f", "module 'hacrl_no_such_module_xyz' not found"),
    ]
    for spec, why in cases:
        with pytest.raises(CheckerError, match=why) as err:
            load_checker(spec, field="--checker")
        assert str(err.value).startswith(f"--checker={spec!r}")
    broken = tmp_path / "broken.py"
    broken.write_text("import nonexistent_dependency_xyz\n")
    with pytest.raises(CheckerError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load_checker(f"{broken}:f")


def test_scorer_pickles_spec_with_absolute_path(checker_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scorer = CustomScorer.from_spec("my_checker.py:exact")
    assert scorer.spec == f"{checker_file}:exact"
    assert pickle.loads(pickle.dumps(scorer)) == scorer
    assert scorer(RewardRequest("math", " 12 ", "12"), "math") == 1.0
    assert custom_score_fn(None) is None


@pytest.mark.parametrize("workers", [0, 1])
def test_pool_scores_with_the_checker_and_counts_its_failures(checker_file, workers):
    reqs = [RewardRequest("math", "5", "5"), RewardRequest("math", "4", "5")]
    with VerifierPool(num_workers=workers, score_fn=custom_score_fn(f"{checker_file}:exact")) as pool:
        assert pool.score(reqs) == [1.0, 0.0]
    with VerifierPool(num_workers=workers, score_fn=custom_score_fn(f"{checker_file}:boom")) as pool:
        assert pool.score(reqs) == [0.0, 0.0] and pool.stats["errors"] == 2
    with VerifierPool(num_workers=workers, score_fn=custom_score_fn(f"{checker_file}:out_of_range")) as pool:
        assert pool.score(reqs[:1]) == [0.0] and pool.stats["errors"] == 1


def test_config_checks_the_checker(checker_file, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    cfg = load_config("cpu_demo", ["data.task=custom", f"data.path={data}", f"data.checker={checker_file}:exact"])
    assert check_data_files(cfg.data) == [data]
    with pytest.raises(ConfigError, match="data.checker='oops': must be"):
        load_config("cpu_demo", ["data.checker=oops"])
    cfg = load_config("cpu_demo", [f"data.checker={checker_file}:one_arg"])  # format is fine; loading is not
    with pytest.raises(ConfigError, match="two positional arguments"):
        check_data_files(cfg.data)
