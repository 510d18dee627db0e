"""hacrl prepare, offline: datasets and models read from a local mirror folder in the hub's layout
(the fixtures of tests/fixtures/datasets arranged as the hub repositories are), written where the
loaders and presets read them; a missing network or a bad mirror is one line and exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hacrl_megatron.cli import main
from hacrl_megatron.data import load_benchmark
from hacrl_megatron.models.parallel import free_port
from hacrl_megatron.prepare import DATASETS

pytest.importorskip("datasets")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def _readme(folder: Path, configs: dict[str, dict[str, str]]) -> None:
    """The dataset card's YAML header that maps configs and splits to files, as on the hub."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {path}" for split, path in splits.items()]
    (folder / "README.md").write_text("\n".join(lines + ["---", "# fixture copy", ""]))


def make_mirror(root: Path) -> Path:
    """Every DATASETS repository with the fixture rows, in its hub layout."""
    def repo(name: str) -> Path:
        path = root / DATASETS[name].repo
        path.mkdir(parents=True)
        return path

    math = repo("math")
    (math / "data").mkdir()
    for split in ("train", "test"):
        shutil.copy(FIXTURES / "math/train.jsonl", math / f"data/{split}-00000-of-00001.jsonl")
    _readme(math, {"default": {"train": "data/train-*", "test": "data/test-*"}})
    shutil.copy(FIXTURES / "math500/test.jsonl", repo("math500") / "test.jsonl")
    gsm = repo("gsm8k")
    (gsm / "main").mkdir()
    for split in ("train", "test"):
        shutil.copy(FIXTURES / "gsm8k/test-00000-of-00001.parquet", gsm / f"main/{split}-00000-of-00001.parquet")
    _readme(gsm, {"main": {"train": "main/train-*", "test": "main/test-*"}})
    aime = repo("aime2025")  # opencompass's release: question/answer, no id, one file per exam
    rows = [json.loads(line) for line in open(FIXTURES / "aime2025/test.jsonl")]
    for exam, part in (("I", rows[:2]), ("II", rows[2:])):
        (aime / f"aime2025-{exam}.jsonl").write_text(
            "".join(json.dumps({"question": r["problem"], "answer": r["answer"]}) + "\n" for r in part))
    _readme(aime, {f"AIME2025-{e}": {"test": f"aime2025-{e}.jsonl"} for e in ("I", "II")})
    for name in ("amc23", "minerva", "olympiadbench"):
        shutil.copy(FIXTURES / name / "test.jsonl", repo(name) / "test.jsonl")
    return root


@pytest.fixture()
def offline_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_every_dataset_from_a_mirror_loads_as_the_fixture(tmp_path, offline_hub, capsys):
    mirror = make_mirror(tmp_path / "mirror")
    assert main(["prepare", "data", "all", "--mirror", str(mirror), "--out", str(tmp_path / "data")]) == 0
    out = capsys.readouterr().out
    for name in DATASETS:
        assert f"hacrl prepare: {name}:" in out
        fixture = {(r.id, r.answer) for r in load_benchmark(name, str(FIXTURES / name))}
        prepared = {(r.id, r.answer) for r in load_benchmark(name, str(tmp_path / "data" / name))}
        assert prepared == fixture, name
    assert sorted(p.name for p in (tmp_path / "data/math").iterdir()) == ["test.jsonl", "train.jsonl"]
    assert sorted(p.name for p in (tmp_path / "data/gsm8k").iterdir()) == ["test.jsonl", "train.jsonl"]


def test_missing_network_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    assert main(["prepare", "data", "gsm8k", "--out", str(tmp_path)]) == 2  # HF_HUB_OFFLINE=1 (conftest)
    assert "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" in _one_line_error(capsys)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert main(["prepare", "data", "math500", "--out", str(tmp_path)]) == 2
    assert "cannot reach http://127.0.0.1:" in _one_line_error(capsys)
    assert main(["prepare", "model", "Qwen/Qwen3-4B", "--out", str(tmp_path)]) == 2
    assert "cannot reach" in _one_line_error(capsys)
    assert not (tmp_path / "math500").exists()


def test_bad_names_and_mirrors_are_one_line(tmp_path, offline_hub, capsys):
    assert main(["prepare", "data", "mmlu", "--out", str(tmp_path)]) == 2
    assert "unknown dataset(s) ['mmlu']" in _one_line_error(capsys)
    assert main(["prepare", "data", "gsm8k", "--mirror", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "no folder" in _one_line_error(capsys)
    broken = tmp_path / "broken" / "openai" / "gsm8k"
    broken.mkdir(parents=True)
    (broken / "notes.txt").write_text("no data here")
    assert main(["prepare", "data", "gsm8k", "--mirror", str(tmp_path / "broken"), "--out", str(tmp_path)]) == 2
    assert "reading " in _one_line_error(capsys)
    assert main(["prepare", "model", "Qwen3-4B", "--out", str(tmp_path)]) == 2
    assert "expected OWNER/NAME" in _one_line_error(capsys)


def _tiny_model_repo(repo: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hacrl_megatron.exchange.tokenizers import load_tokenizer

    cfg = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(repo)
    load_tokenizer("char").save_pretrained(repo)
    (repo / "pytorch_model.bin").write_bytes(b"a duplicate in another format: not fetched")
    (repo / "README.md").write_text("model card")


def test_model_from_a_mirror_keeps_only_what_is_read(tmp_path, offline_hub, capsys):
    repo = tmp_path / "mirror" / "Org" / "Tiny-Llama"
    repo.mkdir(parents=True)
    _tiny_model_repo(repo)
    assert main(["prepare", "model", "Org/Tiny-Llama", "--mirror", str(tmp_path / "mirror"),
                 "--out", str(tmp_path / "models")]) == 0
    folder = tmp_path / "models" / "Tiny-Llama"
    assert f"in {folder}" in capsys.readouterr().out
    names = sorted(p.name for p in folder.iterdir())
    assert "pytorch_model.bin" not in names and "README.md" not in names
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    from hacrl_megatron.eval.run import load_hf_agent

    engine, tokenizer = load_hf_agent(folder)  # what the trainer and hacrl eval read
    assert len(tokenizer) == 99
    capsys.readouterr()  # transformers' loading bar
    (repo / "model.safetensors").unlink()
    assert main(["prepare", "model", "Org/Tiny-Llama", "--mirror", str(tmp_path / "mirror"),
                 "--out", str(tmp_path / "models2")]) == 2
    assert "no *.safetensors weights" in _one_line_error(capsys)


@pytest.mark.slow
def test_model_prepare_converts_to_megatron(tmp_path, offline_hub, capsys):
    repo = tmp_path / "mirror" / "Org" / "Tiny-Llama"
    repo.mkdir(parents=True)
    _tiny_model_repo(repo)
    assert main(["prepare", "model", "Org/Tiny-Llama", "--mirror", str(tmp_path / "mirror"),
                 "--out", str(tmp_path / "models"), "--convert", "--tp", "2"]) == 0
    ckpt = tmp_path / "models" / "Tiny-Llama-megatron-tp2-pp1"
    assert (ckpt / "metadata.json").is_file() and (ckpt / "tokenizer" / "tokenizer.json").is_file()
    assert "(tp=2, pp=1)" in capsys.readouterr().out
