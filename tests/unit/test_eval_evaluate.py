"""evaluate / write_results / run_eval, with a scripted engine (exact numbers) and a real tiny HF model."""

from __future__ import annotations

import json

import pytest
import torch

from hacrl_megatron.data import PromptRecord
from hacrl_megatron.eval import (
    EvalData,
    EvalResult,
    EvalSettings,
    evaluate,
    markdown_table,
    run_eval,
    write_results,
)
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.reward import VerifierPool
from hacrl_megatron.rollout import Completion, HFEngine, RolloutEngine, SamplingParams
from tests.unit.test_rollout_hf import tiny_llama

torch.set_num_threads(1)


class ScriptedEngine:
    """Answers problem i with a fixed list of response texts (a RolloutEngine, no model)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_token_ids, params):
        self.calls.append(params)
        out = []
        for ids in prompt_token_ids:
            texts = self.script[self.tokenizer.decode(ids)]
            assert len(texts) == params.n
            out.append([Completion(tuple(self.tokenizer(t)["input_ids"]), t, "eos") for t in texts])
        return out

    def load_weights(self, named_tensors):
        return 0

    def stats(self):
        return {}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def verifier():
    with VerifierPool(num_workers=0) as pool:
        yield pool


def records(answers):
    return [PromptRecord(id=f"p{i}", question=f"{a - 1}+1=?", answer=str(a), source="toy", kind="integer")
            for i, a in enumerate(answers)]


def test_scripted_engine_exact_metrics(tok, verifier, tmp_path):
    recs = records([3, 5, 7, 9])
    right, wrong = (lambda a: f"\\boxed{{{a}}}"), (lambda a: f"\\boxed{{{a + 1}}}")
    pattern = [[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    script = {f"Q: {r.question} A: ": [right(int(r.answer)) if ok else wrong(int(r.answer)) for ok in row]
              for r, row in zip(recs, pattern, strict=True)}
    engine = ScriptedEngine(tok, script)
    assert isinstance(engine, RolloutEngine)
    settings = EvalSettings(k=2, n=4, greedy=False, temperature=0.6, max_new_tokens=8, template="plain",
                            batch_prompts=3)
    res = evaluate(engine, tok, {"toy": recs, "aime2025": recs}, settings, verifier=verifier, model_name="scripted")
    b = res.benchmarks["toy"]
    assert (b.num_problems, b.samples_per_problem, b.k) == (4, 4, 2)
    assert b.avg == pytest.approx(0.4375) and b.pass_at_k == pytest.approx((1 + 5 / 6 + 0.5) / 4)
    assert b.best_at_k == 0.5 and b.primary_metric == "avg" and b.truncated_fraction == 0.0
    aime = res.benchmarks["aime2025"]  # the paper reports best@k on AIME
    assert aime.primary_metric == "best_at_k" and aime.label == "aime2025 (best@2)"
    assert res.average == pytest.approx((0.4375 + 0.5) / 2)
    assert engine.calls[0] == SamplingParams(n=4, temperature=0.6, max_new_tokens=8, seed=0)
    assert len(engine.calls) == 4  # 4 prompts in batches of 3, two benchmarks
    assert res.samples["toy"][1]["rewards"] == [0.0, 1.0, 1.0, 0.0]

    paths = write_results([res, res], tmp_path)
    table = paths["markdown"].read_text().splitlines()
    assert table[0] == "| model | toy (avg@4) | aime2025 (best@2) | average |"
    assert table[2] == "| scripted | 0.438 | 0.500 | 0.469 |"
    data = json.loads(paths["json"].read_text())
    assert data["results"][0]["benchmarks"]["toy"]["pass_at_k"] == pytest.approx(b.pass_at_k)
    assert len(paths["samples"].read_text().splitlines()) == 2 * 8


def test_evaluate_validates(tok, verifier):
    engine = ScriptedEngine(tok, {})
    with pytest.raises(ValueError, match="greedy decoding gives identical samples"):
        EvalSettings(k=2)
    with pytest.raises(ValueError, match="n >= k >= 1"):
        EvalSettings(k=3, n=2, greedy=False)
    with pytest.raises(ValueError, match="primary\\['toy'\\]='max'"):
        EvalSettings(primary={"toy": "max"})
    with pytest.raises(ValueError, match="batch_prompts=0"):
        EvalSettings(batch_prompts=0)
    with pytest.raises(ValueError, match="'toy' has no records"):
        evaluate(engine, tok, {"toy": []}, verifier=verifier)
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        EvalData(["nope"])
    with pytest.raises(ValueError, match=r"paths given for benchmarks not requested: \['math'\]"):
        EvalData(["gsm8k"], {"math": "x.jsonl"})


def test_markdown_table_missing_cells():
    from hacrl_megatron.eval import BenchmarkResult

    a = EvalResult("a", {"x": BenchmarkResult("x", 2, 1, 1, 0.5, 0.5, 0.5)})
    b = EvalResult("b", {"y": BenchmarkResult("y", 2, 1, 1, 0.25, 0.25, 0.25)})
    assert markdown_table([a, b]).splitlines()[2:] == ["| a | 0.500 | – | 0.500 |", "| b | – | 0.250 | 0.250 |"]


def test_run_eval_on_saved_tiny_model(tok, tmp_path):
    model = tiny_llama(len(tok))
    model.save_pretrained(tmp_path / "agent")
    tok.save_pretrained(tmp_path / "agent")
    data, settings = EvalData(["addition"], limit=8), EvalSettings(k=1, max_new_tokens=6, template="plain")
    res = run_eval(tmp_path / "agent", data, settings, out_dir=tmp_path / "eval")
    b = res.benchmarks["addition"]
    assert res.model == "agent" and b.num_problems == 8 and 0.0 <= b.avg <= 1.0
    assert b.mean_response_tokens <= 6
    assert (tmp_path / "eval" / "results.md").read_text().startswith("| model | addition (avg@1) | average |")
    # the same through a ready engine: identical greedy results
    engine = HFEngine(model, tok)
    again = run_eval(engine, data, settings, tokenizer=tok)
    assert again.samples["addition"] == res.samples["addition"]
    assert again.settings == res.settings == {"k": 1, "n": 1, "greedy": True, "temperature": 0.0, "top_p": 1.0,
                                              "max_new_tokens": 6, "template": "plain", "seed": 0}
    with pytest.raises(ValueError, match="needs its tokenizer"):
        run_eval(engine, data)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        run_eval(tmp_path / "missing", data)


def test_run_eval_dataset_fixture(tok, tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}, {"question": "What is 3+3?", "answer": "#### 6"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    script = {"Q: What is 2+2? A: ": ["\\boxed{4}"], "Q: What is 3+3? A: ": ["\\boxed{5}"]}
    res = run_eval(ScriptedEngine(tok, script), EvalData(["gsm8k"], {"gsm8k": str(path)}),
                   EvalSettings(template="plain"), tokenizer=tok)
    assert res.benchmarks["gsm8k"].avg == 0.5
