"""The smaller frictions a new user met (issue 33, point 7), each pinned: labelled progress numbers, a
missing data file named as a file, README examples that run as written, every preset in the presets
table, exported agents that stop at their tokenizer's end token, and a script without a __main__ guard
told what is wrong."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from hacrl_megatron.cli import main
from hacrl_megatron.config import preset_names
from hacrl_megatron.exchange.tokenizers import load_tokenizer
from hacrl_megatron.trainer import loop
from tests.e2e.test_trainer import tiny_exp
from tests.faults.trainer_helpers import exp_with

README = Path(__file__).resolve().parents[2] / "README.md"


def test_progress_numbers_are_labelled(tmp_path, capsys):
    loop.train(exp_with(tiny_exp(tmp_path, steps=1), log={"progress": True}))
    err = capsys.readouterr().err
    assert re.search(r"llama reward=\d\.\d{3}, qwen3 reward=\d\.\d{3}", err), err[-500:]


def test_a_missing_data_file_is_named_as_a_file(tmp_path, capsys):
    missing = tmp_path / "mine.jsonl"
    assert main(["config", "data.task=custom", f"data.path={missing}"]) == 2
    assert f"data.path='{missing}': benchmark 'custom': no such file {missing}" in capsys.readouterr().err


def test_readme_eval_examples_name_their_benchmarks():
    text = README.read_text(encoding="utf-8")
    commands = re.findall(r"hacrl eval --agent [^`\n]+", text)  # commands, not the flag named in prose
    assert commands and all("--benchmarks" in c for c in commands), commands


def test_the_presets_table_lists_every_preset():
    text = README.read_text(encoding="utf-8")
    table = text.split("| preset | what | runs on |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([a-z0-9_]+)`", table, flags=re.M))
    assert set(preset_names()) <= listed, sorted(set(preset_names()) - listed)


def test_exported_agents_carry_their_tokenizers_special_ids(tmp_path):
    from transformers import AutoModelForCausalLM

    exp = tiny_exp(tmp_path, steps=1)
    loop.train(exp)
    for agent in exp.agents:
        folder = Path(exp.output_dir) / "final" / agent.name
        config = json.loads((folder / "config.json").read_text())
        tokenizer = load_tokenizer(agent.tokenizer)
        assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (
            tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id)
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.generation_config.eos_token_id == tokenizer.eos_token_id  # plain generate() stops there


SCRIPT = '''
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.reward.verify import RewardRequest

def run():
    with VerifierPool(num_workers=1, startup_timeout_s=60) as pool:
        print("scores", pool.score([RewardRequest("math", "\\\\boxed{1}", "1")]))
'''


def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    unguarded, guarded = tmp_path / "unguarded.py", tmp_path / "guarded.py"
    unguarded.write_text(SCRIPT + "\nrun()\n")
    guarded.write_text(SCRIPT + '\nif __name__ == "__main__":\n    run()\n')
    bad = subprocess.run([sys.executable, str(unguarded)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert bad.returncode != 0 and 'put that call under `if __name__ == "__main__":`' in bad.stderr
    good = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert good.returncode == 0 and "scores [1.0]" in good.stdout, good.stderr[-500:]
