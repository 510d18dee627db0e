"""Problem families of a procedural task (``add_sub_cot``: ``add`` and ``sub``): each family's own streams,
the weighted mixture a warm-up trains on (``agents.*.warmup_sft_families``), the subtraction's
column-by-column target, the config's refusals, and the per-family accuracy a run logs
(``<agent>/eval/<family>/accuracy``)."""

from __future__ import annotations

import collections

import pytest

from hacrl_megatron.config import ConfigError, load_config
from hacrl_megatron.data import PromptRecord, make_task
from hacrl_megatron.data.procedural import cot_borrow_columns
from hacrl_megatron.metric_names import describe
from hacrl_megatron.reward import RewardRequest, score_request
from hacrl_megatron.trainer import evaluation, pretrain


def test_subtraction_targets_work_column_by_column_with_borrows():
    assert cot_borrow_columns(52, 17, 2) == "12-7=5,5-1-1=3"  # borrow in the ones, repaid in the tens
    assert cot_borrow_columns(75, 23, 2) == "5-3=2,7-2=5"  # no borrow
    assert cot_borrow_columns(52, 47, 2) == "12-7=5,5-4-1=0"  # leading zero of the difference
    assert cot_borrow_columns(100, 1, 3) == "10-1=9,10-0-1=9,1-0-1=0"  # a borrow passed along a zero
    assert cot_borrow_columns(7, 7, 1) == "7-7=0"
    with pytest.raises(ValueError, match="a=3 must be >= b=5"):
        cot_borrow_columns(3, 5, 1)
    task = make_task("add_sub_cot", 2, 3)
    sub = task.sample(1, offset=0, family="sub")[0]
    a, b = (int(v) for v in sub.question[:-2].split("-"))
    assert a >= b and sub.answer == str(a - b)
    assert task.sft_target(sub) == f"{cot_borrow_columns(a, b, 2)} \\boxed{{{a - b}}}"
    add = task.sample(1, offset=0, family="add")[0]
    x, y = (int(v) for v in add.question[:-2].split("+"))
    assert add.answer == str(x + y) and task.sft_target(add).startswith(f"{x % 10}+{y % 10}=")


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_each_family_has_its_own_streams_disjoint_from_its_held_out_set(difficulty):
    task = make_task("add_sub_cot", difficulty, 1234)
    for family, op in (("add", "+"), ("sub", "-")):
        train, held_out = task.sample(400, family=family), task.eval_set(30, family=family)
        assert all(op in r.question and task.family_of(r) == family for r in train + held_out)
        assert not {r.question for r in train} & {r.question for r in held_out}
        assert train[5].id == f"add_sub_cot-d{difficulty}-s1234-train-{family}-5"
        assert task.sample(3, offset=5, family=family) == train[5:8]  # a resumed warm-up continues the stream
        for rec in train[:40] + held_out:
            target = task.sft_target(rec)  # regenerated from the id alone
            assert score_request(RewardRequest(rec.kind, target, rec.answer)) == 1.0
    # the mixed stream holds both, the held-out set of the mix too, none of it trained on
    mixed, held_out = task.sample(400), task.eval_set(40)
    assert {task.family_of(r) for r in mixed} == {"add", "sub"}
    assert not {r.question for r in mixed} & {r.question for r in held_out}


def test_a_mixture_draws_the_weighted_families_and_resumes_where_it_stopped():
    task = make_task("add_sub_cot", 2, 7)
    counts = collections.Counter(task.family_of(r) for r in task.sample_mix(2000, 0, {"add": 0.85, "sub": 0.15}))
    assert 0.82 < counts["add"] / 2000 < 0.88  # deterministic (seeded per item): a fixed count, not a flaky one
    assert task.sample_mix(10, 30, {"add": 0.85, "sub": 0.15}) == task.sample_mix(40, 0, {"add": 0.85, "sub": 0.15})[30:]
    only_sub = task.sample_mix(50, 0, {"sub": 1.0, "add": 0.0})
    assert {task.family_of(r) for r in only_sub} == {"sub"}
    assert only_sub[3] == task.sample(1, offset=3, family="sub")[0]  # item i of the family's own stream
    assert collections.Counter(task.family_of(r) for r in task.sample(2000))["add"] / 2000 == pytest.approx(0.5, abs=0.04)


def test_family_errors_name_the_problem():
    task = make_task("add_sub_cot", 2, 1)
    with pytest.raises(ValueError, match="family 'mul' is not one of this task's families"):
        task.sample(2, family="mul")
    with pytest.raises(ValueError, match="family 'mul' is not one of this task's families"):
        task.eval_set(2, family="mul")
    with pytest.raises(ValueError, match="give no family a positive weight"):
        task.sample_mix(2, 0, {"add": 0.0})
    with pytest.raises(ValueError, match="weight of 'add' is -1"):
        task.sample_mix(2, 0, {"add": -1})
    with pytest.raises(ValueError, match="names family 'mul'"):
        task.sft_target(PromptRecord(id="add_sub_cot-d2-s1-train-mul-3", question="1+1=?", answer="2",
                                     source="add_sub_cot", kind="integer"))
    with pytest.raises(ValueError, match="neither a sum nor a difference"):
        task.family_of(PromptRecord(id="x", question="3*4=?", answer="12", source="add_sub_cot", kind="integer"))
    plain = make_task("addition_cot", 2, 1)
    assert plain.families == () and plain.family_of(plain.sample(1)[0]) is None
    with pytest.raises(ValueError, match="family 'add' is not one of this task's families \\(none\\)"):
        plain.sample(1, family="add")


COMPLEMENT = ["agents.1.warmup_sft_families={sub: 1}"]


@pytest.mark.parametrize(("sets", "message"), [
    (["agents.0.warmup_sft_families={mul: 1}"], r"agents\.0\.warmup_sft_families\.mul=1\.0: 'mul' is not a family"),
    (["agents.0.warmup_sft_families={add: -0.5}"], r"agents\.0\.warmup_sft_families\.add=-0\.5: must be a finite"),
    (["agents.0.warmup_sft_families={add: .nan}"], r"agents\.0\.warmup_sft_families\.add=nan: must be a finite"),
    (["agents.0.warmup_sft_families={add: 0, sub: 0}"], r"agents\.0\.warmup_sft_families=.*positive weight"),
    (["agents.0.warmup_sft_families=[add]"], r"agents\.0\.warmup_sft_families: expected a mapping"),
    (["agents.0.warmup_sft_families={add: lots}"], r"agents\.0\.warmup_sft_families\.add: expected a number"),
    (["data.task=addition_cot"], r"agents\.0\.warmup_sft_families=.*has no problem families.*add_sub_cot"),
])
def test_config_refuses_a_bad_mixture_naming_the_field(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu_complement", [*COMPLEMENT, *sets])


def test_the_mixture_is_part_of_the_warmup_key_and_shared_by_a_later_snapshot():
    exp = load_config("cpu_complement")
    other = load_config("cpu_complement", ["agents.0.warmup_sft_families={add: 0.9, sub: 0.1}"])
    assert pretrain.warmup_key(exp, 0) != pretrain.warmup_key(other, 0)
    assert pretrain.warmup_key(exp, 1) == pretrain.warmup_key(other, 1)
    same_in_another_order = load_config("cpu_complement", ["agents.0.warmup_sft_families={sub: 0.15, add: 0.85}"])
    assert pretrain.warmup_key(same_in_another_order, 0) == pretrain.warmup_key(exp, 0)
    with pytest.raises(ConfigError, match=r"agents\.1\.warmup_sft_families=.*must equal adder's"):
        load_config("cpu_complement", ["agents.1.warmup_sft_from=adder", "agents.1.warmup_sft_target=0.7"])


def test_the_warmup_checks_the_weighted_accuracy_of_its_own_mixture(monkeypatch):
    task = make_task("add_sub_cot", 2, 1)
    check = pretrain.WarmupCheck(task, {"add": 3.0, "sub": 1.0})
    assert set(check.records) == {"add", "sub"} and all(len(v) == pretrain.EVAL_ITEMS for v in check.records.values())

    class Runtime:
        name = "adder"

    def fake(runtimes, records, verifier, max_len):  # adds right, subtracts right one time in five
        return {"adder": 0.9 if task.family_of(records[0]) == "add" else 0.2}

    monkeypatch.setattr(pretrain, "evaluate_agents", fake)
    accuracy, per_family = check.accuracy(Runtime(), None, 32)
    assert per_family == {"add": 0.9, "sub": 0.2} and accuracy == pytest.approx((3 * 0.9 + 0.2) / 4, abs=1e-12)


def test_a_run_logs_each_familys_accuracy_and_the_plain_mean_of_all(monkeypatch):
    task = make_task("add_sub_cot", 2, 1)
    records = task.eval_set(50)
    right = {r.id for r in records[::3]}  # every third problem answered right, whatever its family

    def fake(runtimes, group, verifier, max_len):
        return {rt.name: sum(r.id in right for r in group) / len(group) for rt in runtimes}

    monkeypatch.setattr(evaluation, "evaluate_agents", fake)

    class Runtime:
        def __init__(self, name):
            self.name = name

    overall, families = evaluation.evaluate_agents_by_family([Runtime("adder"), Runtime("subtractor")], records,
                                                             task.family_of, None, 32)
    groups = {f: [r for r in records if task.family_of(r) == f] for f in ("add", "sub")}
    for name in ("adder", "subtractor"):
        assert overall[name] == len(right) / 50  # the count of right answers over all, exactly
        for family, group in groups.items():
            key = f"{name}/eval/{family}/accuracy"
            assert families[key] == sum(r.id in right for r in group) / len(group)
            assert describe(key, ["adder", "subtractor"])[1] == "fraction"


def test_a_training_run_on_a_task_with_families_logs_them(tmp_path):
    import dataclasses
    import json

    from hacrl_megatron.trainer import loop
    from tests.e2e.test_trainer import tiny_exp

    exp = tiny_exp(tmp_path, steps=1, eval_every=1)
    exp = dataclasses.replace(exp, data=dataclasses.replace(exp.data, task="add_sub_cot", difficulty=1, eval_size=12),
                              hacpo=dataclasses.replace(exp.hacpo, log_cross_grad_share=True))
    loop.train(exp)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "llama/eval_accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 1]
    for row in evaluated:
        for agent in ("llama", "qwen3"):
            assert {f"{agent}/eval/add/accuracy", f"{agent}/eval/sub/accuracy"} <= set(row)
            assert all(0 <= row[f"{agent}/eval/{f}/accuracy"] <= 1 for f in ("add", "sub"))
    trained = next(r for r in rows if r["step"] == 1 and "llama/hacpo/cross_grad_share" in r)
    assert all(0 <= trained[f"{a}/hacpo/cross_grad_share"] <= 1 for a in ("llama", "qwen3"))
    assert all(describe(k, ["llama", "qwen3"]) is not None for r in rows for k in r)  # every name documented
