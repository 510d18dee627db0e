"""Ecosystem formats: a verl-layout dataset (chat-list prompt, reward_model.ground_truth, data_source,
extra_info) and verl's compute_score signature train the agents with no other key; other layouts by
data.prompt_key / data.answer_key; rewards in a declared data.reward_range; dataset tasks train on their
train split."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.data import make_task
from hacrl_megatron.data.formats import chat_question, column_row, record_origin
from hacrl_megatron.reward.custom import CustomScorer, call_checker, is_verl_style
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.reward.verify import RewardRequest
from hacrl_megatron.trainer.metrics import read_metrics
from tests.e2e.test_trainer import tiny_exp
from tests.faults.trainer_helpers import exp_with, preset_file

SYSTEM = {"role": "system", "content": "You are a careful calculator."}
VERL_CHECKER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's signature; fails loudly when the row's data_source or extra_info did not arrive
    assert data_source == "openai/gsm8k", data_source
    assert isinstance(extra_info, dict) and extra_info["split"] == "train", extra_info
    digits = "".join(c for c in solution_str if c.isdigit())
    return {"score": 1.0 if digits.endswith(str(ground_truth)) else 0.0, "acc": 0.0}


def signed(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if str(ground_truth) in solution_str else -1.0
'''


def verl_rows(n: int = 40) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append({"data_source": "openai/gsm8k", "ability": "math",
                     "prompt": [SYSTEM, {"role": "user", "content": f"{a}+{b}=?"}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i}})
    return rows


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_rows_become_records_with_their_source_and_extra_info(tmp_path):
    row = verl_rows(1)[0]
    assert column_row(row, (None, None)) == {"id": 0, "solution": None, "question": "0+0=?", "answer": "0"}
    assert record_origin(row, "custom") == ("openai/gsm8k", json.dumps({"split": "train", "index": 0}))
    assert chat_question([SYSTEM]) == "You are a careful calculator."  # no user turn: every content
    task = make_task("custom", seed=0, path=str(write_parquet(tmp_path / "train.parquet", verl_rows())),
                     eval_holdout=4)
    rec = task.sample(1)[0]
    assert rec.source == "openai/gsm8k" and json.loads(rec.extra)["split"] == "train"
    assert rec.question.endswith("=?") and rec.id.startswith("custom-")
    other = [{"q": {"text": "2+2=?"}, "gt": 4, "id": "x"}]
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other * 3))
    with pytest.raises(Exception, match="column question"):  # neither our layout nor verl's
        make_task("custom", seed=0, path=str(tmp_path / "other.jsonl"), eval_holdout=0)
    keyed = [{**r, "id": f"x{i}"} for i, r in enumerate(other * 3)]
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keyed))
    task = make_task("custom", seed=0, path=str(tmp_path / "other.jsonl"), eval_holdout=0, columns=("q.text", "gt"))
    assert {(r.question, r.answer) for r in task.sample(3)} == {("2+2=?", "4")}


def test_verl_compute_score_is_told_by_its_signature_and_gets_the_rows_fields(tmp_path):
    checker = tmp_path / "score.py"
    checker.write_text(VERL_CHECKER)
    extra = json.dumps({"split": "train", "index": 3})
    request = RewardRequest("math", "so 7", "7", "openai/gsm8k", extra)
    scorer = CustomScorer.from_spec(f"{checker}:compute_score")
    assert scorer(request, "math") == 1.0 and scorer(RewardRequest("math", "8", "7", "openai/gsm8k", extra), "") == 0.0
    signed = CustomScorer.from_spec(f"{checker}:signed", reward_range=(-1.0, 1.0))
    assert signed(request, "math") == 1.0 and signed(RewardRequest("math", "8", "7"), "math") == 0.0  # −1 → 0
    plain = CustomScorer.from_spec(f"{checker}:signed")  # the default range [0, 1]: −1 is refused, scored 0
    with VerifierPool(num_workers=0, score_fn=plain) as pool:
        assert pool.score([RewardRequest("math", "8", "7")]) == [0.0] and pool.stats["errors"] == 1
    assert is_verl_style(lambda data_source, solution_str, ground_truth, extra_info=None: 0.0)
    assert not is_verl_style(lambda response, reference: 0.0)
    assert call_checker(lambda r, ref: 0.5, request) == 0.5


def test_a_verl_parquet_and_compute_score_train_the_agents_with_no_other_key(tmp_path, capsys):
    data = write_parquet(tmp_path / "train.parquet", verl_rows())
    (tmp_path / "score.py").write_text(VERL_CHECKER)
    exp = exp_with(tiny_exp(tmp_path, steps=2), train={"verifier_workers": 1})
    preset = preset_file(tmp_path, exp)
    rc = main(["train", "--preset", preset, "data.task=custom", f"data.path={data}",
               f"data.checker={tmp_path / 'score.py'}:compute_score"])
    assert rc == 0, capsys.readouterr().err
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["verifier/errors"] == 0  # every call had the row's data_source and extra_info
    assert all(0.0 <= r[f"{a}/reward_mean"] <= 1.0 for r in rows for a in ("llama", "qwen3"))
    assert "llama/hacpo/loss" in rows[-1]


def test_reward_range_is_declared_and_checked(capsys):
    assert main(["config", "data.reward_range=[1, 1]"]) == 2
    assert "data.reward_range=[1.0, 1.0]: must be [low, high], two finite numbers with low < high" in (
        capsys.readouterr().err)
    assert main(["config", "data.prompt_key=question"]) == 2
    assert "data.prompt_key='question': names a column of a custom file" in capsys.readouterr().err


def test_dataset_tasks_train_on_their_train_split(tmp_path, capsys):
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    row = {"question": "1+1?", "answer": "so #### 2"}
    (folder / "test.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["config", "data.task=gsm8k", f"data.path={folder}"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'test.jsonl'} is a test split" in err and "data.allow_test_split=true" in err
    assert main(["config", "data.task=gsm8k", f"data.path={folder}", "data.allow_test_split=true",
                 "train.eval_every=0"]) == 0
    capsys.readouterr()
    (folder / "train.jsonl").write_text("".join(json.dumps({**row, "question": f"{i}+1?"}) + "\n" for i in range(20)))
    task = make_task("gsm8k", path=str(folder), eval_holdout=0)  # the train file, next to the test file
    assert {r.question for r in task.sample(20)} == {f"{i}+1?" for i in range(20)}
    assert main(["config", "data.task=math500"]) == 2
    assert "data.task='math500': math500 is a test set (no train split)" in capsys.readouterr().err


def test_hacrl_eval_takes_a_verl_checker_and_its_reward_range(tmp_path, capsys):
    from hacrl_megatron.exchange import load_tokenizer
    from tests.unit.test_rollout_hf import tiny_llama

    tok = load_tokenizer("char", tmp_path / "tok")
    tiny_llama(len(tok), seed=0).save_pretrained(tmp_path / "agent")
    tok.save_pretrained(tmp_path / "agent")
    (tmp_path / "score.py").write_text(
        "def signed(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'addition'\n    return -1.0\n")
    args = ["eval", "--agent", str(tmp_path / "agent"), "--benchmarks", "addition", "--limit", "3",
            "--max-new-tokens", "3", "--template", "plain", "--checker", f"{tmp_path / 'score.py'}:signed"]
    assert main([*args, "--reward-range", "-2", "0"]) == 0  # −1 maps to 0.5 of [−2, 0]: above LOW, correct
    assert "| agent | 1.000 | 1.000 |" in capsys.readouterr().out
    assert main(args) == 0  # the default range [0, 1]: −1 lies outside, scores 0 (a verifier error)
    assert "| agent | 0.000 | 0.000 |" in capsys.readouterr().out
    assert main([*args, "--reward-range", "1", "1"]) == 2
    assert "--reward-range=[1.0, 1.0]: must be LOW HIGH" in capsys.readouterr().err
