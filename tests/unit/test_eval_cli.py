"""`hacrl eval` end to end on saved tiny HF agents (two rows, one procedural benchmark)."""

from __future__ import annotations

import json

import pytest
import torch

from hacrl_megatron.cli import main
from hacrl_megatron.exchange import load_tokenizer
from tests.unit.test_rollout_hf import tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    out = []
    for name, tok_name, seed in (("a", "char", 0), ("b", "pair", 1)):
        tok = load_tokenizer(tok_name, root / "tok")
        tiny_llama(len(tok), seed=seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out.append(root / name)
    return out


def test_hacrl_eval_two_agents(agents, tmp_path, capsys):
    rc = main(["eval", "--agent", str(agents[0]), "--agent", str(agents[1]), "--benchmarks", "addition",
               "--limit", "6", "--max-new-tokens", "5", "--template", "plain", "--out", str(tmp_path)])
    assert rc == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| model | addition (avg@1) | average |"
    assert [row.split(" | ")[0] for row in table[2:]] == ["| a", "| b"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["model"] for r in data["results"]] == ["a", "b"]
    assert data["results"][1]["benchmarks"]["addition"]["num_problems"] == 6
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 12


def test_hacrl_eval_sampling_and_errors(agents, capsys):
    rc = main(["eval", "--agent", str(agents[0]), "--name", "A", "--benchmarks", "addition", "--limit", "4",
               "--max-new-tokens", "4", "--sample", "--k", "2", "--n", "3", "--template", "plain"])
    assert rc == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("| A | ")
    with pytest.raises(SystemExit, match="2 --name values for 1 --agent"):
        main(["eval", "--agent", str(agents[0]), "--name", "x", "--name", "y", "--benchmarks", "addition"])
