"""Procedural tasks: determinism, resumable offsets, train/eval disjointness, SFT targets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hacrl_megatron.data import TASKS, PromptRecord, make_task
from hacrl_megatron.data.procedural import cot_columns
from hacrl_megatron.reward import RewardRequest, parse_countdown_reference, score_request
from hacrl_megatron.reward.countdown import countdown_expression_value

# Pinned first items (difficulty 2, seed 1234): a change here changes every experiment's data.
PINNED = {
    "addition": [("44+44=?", "88"), ("20+28=?", "48"), ("25+79=?", "104")],
    "addition_cot": [("25+45=?", "70"), ("35+98=?", "133"), ("23+64=?", "87")],
    "add_sub_cot": [("19+43=?", "62"), ("67-34=?", "33"), ("81+47=?", "128")],
    "arithmetic": [("47+70-86=?", "31"), ("48+10*98=?", "1028"), ("88-92+52=?", "48")],
    "linear": [
        ("Solve for x: 3*x+75=-144", "-73"),
        ("Solve for x: -87*x-73=4451", "-52"),
        ("Solve for x: -13*x+70=1331", "-97"),
    ],
    "countdown": [
        ("Make 31 from 3, 15, 3, 10 using + - * / (each number at most once).", "31|3,15,3,10"),
        ("Make 6 from 13, 8, 15, 2 using + - * / (each number at most once).", "6|13,8,15,2"),
        ("Make 3 from 8, 7, 10, 15 using + - * / (each number at most once).", "3|8,7,10,15"),
    ],
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_pinned_items(name):
    task = make_task(name, 2, 1234)
    assert [(r.question, r.answer) for r in task.sample(3)] == PINNED[name]


def test_same_items_in_a_fresh_process_with_another_hash_seed():
    code = (
        "import json; from hacrl_megatron.data import make_task; "
        "print(json.dumps([[r.question, r.answer] for n in ('addition','countdown') "
        "for r in make_task(n, 2, 1234).sample(3)]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="987")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    expected = [list(x) for n in ("addition", "countdown") for x in PINNED[n]]
    assert json.loads(out.stdout) == expected


@pytest.mark.parametrize("name", sorted(TASKS))
def test_offsets_resume_and_seeds_differ(name):
    task = make_task(name, 2, 5)
    assert task.sample(6, offset=4) == task.sample(10)[4:]
    assert make_task(name, 2, 5).sample(10) == task.sample(10)
    assert [r.question for r in make_task(name, 2, 6).sample(10)] != [r.question for r in task.sample(10)]
    ids = [r.id for r in task.sample(50)]
    assert len(set(ids)) == 50 and ids[7] == f"{name}-d2-s5-train-7"


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_eval_disjoint_and_sft_targets_are_correct(name, difficulty):
    task = make_task(name, difficulty, 1234)
    train = task.sample(300)
    evals = task.eval_set(40)
    assert len(evals) == 40
    assert not {r.question for r in train} & {r.question for r in evals}
    for rec in train[:60] + evals:
        assert isinstance(rec, PromptRecord) and rec.source == name
        target = task.sft_target(rec)
        assert target.endswith("}") and "\\boxed{" in target
        assert score_request(RewardRequest(rec.kind, target, rec.answer)) == 1.0
        assert (
            score_request(RewardRequest(rec.kind, target.replace("\\boxed{", "\\boxed{9"), rec.answer)) == 0.0
        )


def test_addition_cot_targets_work_column_by_column():
    assert cot_columns(14, 56, 2) == "4+6=10,1+5+1=7"
    assert cot_columns(99, 99, 2) == "9+9=18,9+9+1=19"
    assert cot_columns(382, 664, 3) == "2+4=6,8+6=14,3+6+1=10"
    assert cot_columns(3, 4, 1) == "3+4=7"
    task = make_task("addition_cot", 2, 0)
    for rec in task.sample(200):
        a, b = map(int, rec.question[:-2].split("+"))
        target = task.sft_target(rec)
        steps, boxed = target.split(" ")
        assert boxed == f"\\boxed{{{a + b}}}" and len(target) <= 27
        carry, digits = 0, []
        for i, step in enumerate(steps.split(",")):  # each column's sum is right, carry included
            lhs, total = step.split("=")
            assert lhs == f"{a // 10**i % 10}+{b // 10**i % 10}" + ("+1" if carry else "")
            assert int(total) == sum(map(int, lhs.split("+")))
            carry = int(total) // 10
            digits.append(total if i == 1 else total[-1])
        assert int("".join(reversed(digits))) == a + b
        # the verifier reads the boxed answer only: wrong working with the right box still scores 1
        assert score_request(RewardRequest(rec.kind, f"0+0=0 {boxed}", rec.answer)) == 1.0
        assert score_request(RewardRequest(rec.kind, f"{steps} \\boxed{{{a + b + 1}}}", rec.answer)) == 0.0
    assert task.sample(5)[0].id.startswith("addition_cot-d2-s0-train-")


def test_question_shapes():
    add = make_task("addition", 2, 0).sample(200)
    assert all(re.fullmatch(r"\d{2}\+\d{2}=\?", r.question) for r in add)
    assert all(int(r.answer) == sum(map(int, r.question[:-2].split("+"))) for r in add)
    one_digit = make_task("addition", 1, 0).sample(100)
    assert all(re.fullmatch(r"\d\+\d=\?", r.question) for r in one_digit)
    for rec in make_task("linear", 2, 0).sample(100):
        m = re.fullmatch(r"Solve for x: (-?\d+)\*x([+-]\d+)?=(-?\d+)", rec.question)
        a, b, c = int(m[1]), int(m[2] or 0), int(m[3])
        assert a * int(rec.answer) + b == c
    for rec in make_task("countdown", 3, 0).sample(100):
        target, numbers = parse_countdown_reference(rec.answer)
        assert len(numbers) == 5 and all(1 <= n <= 30 for n in numbers)
        assert target not in numbers and 1 <= target <= 10_000
        expr = make_task("countdown", 3, 0).sft_target(rec)[len("\\boxed{") : -1]
        assert countdown_expression_value(expr, numbers) == target


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown task 'sudoku'; procedural tasks: addition, addition_cot, arithmetic"):
        make_task("sudoku", 2, 0)
    with pytest.raises(ValueError, match=r"difficulty=0 must be an int in \[1, 12\]"):
        make_task("addition", 0, 0)
    with pytest.raises(ValueError, match="seed='a'"):
        make_task("addition", 2, "a")
    with pytest.raises(ValueError, match="n=-1"):
        make_task("addition", 2, 0).sample(-1)
    foreign = make_task("addition", 2, 1).sample(1)[0]
    with pytest.raises(ValueError, match="was not produced by task addition"):
        make_task("addition", 2, 0).sft_target(foreign)


def test_tiny_space_eval_set_cycles_without_leaking():
    task = make_task("addition", 1, 1234)
    evals = task.eval_set(60)
    assert len(evals) == 60
    train_q = {r.question for r in task.sample(2000)}
    assert not train_q & {r.question for r in evals}
