"""`hacrl plan` and `hacrl convert` on hostile inputs: a config.json with a float size, zero heads, a string
where a number belongs or no JSON at all; NaN or negative sizes on the command line; a billion nodes.
Each exits 2 with one line naming the file, field or option, in bounded time, before any world spawns."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hacrl_megatron.cli import main

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


CONFIGS = {  # what config.json holds, and what the line must say after the file's path
    "float size": ({**LLAMA, "hidden_size": 1e300}, "hidden_size"),
    "zero heads": ({**LLAMA, "num_attention_heads": 0}, ""),
    "zero kv heads": ({**LLAMA, "num_key_value_heads": 0}, "num_key_value_heads=0: must be an integer in [1, "),
    "negative layers": ({**LLAMA, "num_hidden_layers": -3}, "num_hidden_layers=-3: must be an integer in [1, "),
    "huge vocab": ({**LLAMA, "vocab_size": 10**30}, "vocab_size=1000000000000000000000000000000: must be an integer"),
    "string size": ({**LLAMA, "vocab_size": "x"}, "vocab_size"),
    "NaN eps": ({**LLAMA, "rms_norm_eps": float("nan")}, "rms_norm_eps=nan: must be a finite number > 0"),
    "not JSON": ("not json{", "not a readable JSON config (Expecting value: line 1 column 1"),
    "a JSON list": ([1, 2], "expected a JSON object, got list"),
}


def _model(tmp_path, content) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_plan_on_a_bad_config_json_names_the_file(tmp_path, capsys, case):
    content, expected = CONFIGS[case]
    folder = _model(tmp_path, content)
    assert main(["plan", "--model", folder, "--tp", "1", "--pp", "1", "--dp", "1", "--gpu-memory-gib", "80"]) == 2
    line = _one_line(capsys, f"hacrl plan: {folder}/config.json: ")
    assert expected in line


@pytest.mark.parametrize("case, expected", [
    ("float size", "hidden_size"), ("zero heads", "cannot be read as an HF config"),
    ("negative layers", "num_hidden_layers=-3: must be an integer in [1, "), ("string size", "vocab_size"),
    ("not JSON", "is not a valid JSON file"),
])
def test_convert_on_a_bad_config_json_names_the_file(tmp_path, capsys, case, expected):
    from safetensors.torch import save_file

    folder = _model(tmp_path, CONFIGS[case][0])
    save_file({"model.norm.weight": torch.ones(4)}, f"{folder}/model.safetensors")
    assert main(["convert", "--from-hf", folder, "--to-hf", str(tmp_path / "out"), "--tp", "2"]) == 2
    assert expected in _one_line(capsys, f"hacrl convert: {folder}/config.json: ")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_convert_refuses_a_shard_size_that_is_no_size_before_spawning(tmp_path, capsys, value):
    folder = _model(tmp_path, LLAMA)
    start = time.monotonic()
    assert main(["convert", "--from-hf", folder, "--to-hf", str(tmp_path / "out"), "--tp", "2",
                 "--max-shard-gb", value]) == 2
    assert _one_line(capsys, "hacrl convert: ") == \
        f"hacrl convert: --max-shard-gb={float(value):g}: must be a finite number > 0"
    assert time.monotonic() - start < 10  # no world of two ranks was started


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_plan_refuses_a_gpu_memory_that_is_no_size(tmp_path, capsys, value):
    folder = _model(tmp_path, LLAMA)
    assert main(["plan", "--model", folder, "--tp", "1", "--pp", "1", "--dp", "1", "--gpu-memory-gib", value]) == 2
    assert _one_line(capsys, "hacrl plan: ") == \
        f"hacrl plan: --gpu-memory-gib={float(value):g}: must be a finite number > 0"


@pytest.mark.parametrize("option, value", [("--nodes", "1000000000"), ("--gpus-per-node", "100000")])
def test_plan_refuses_a_cluster_it_cannot_search_in_bounded_time(capsys, option, value):
    args = {"--nodes": "2", "--gpus-per-node": "8", option: value}
    start = time.monotonic()
    assert main(["plan", "--preset", "cpu_demo", "--gpu-memory-gib", "80", *[x for kv in args.items() for x in kv]]) == 2
    assert time.monotonic() - start < 10
    assert _one_line(capsys, "hacrl plan: ").startswith(f"hacrl plan: {option}={value}: at most ")


@pytest.mark.parametrize("option, value, least", [
    ("--seq-len", "0", 4), ("--seq-len", "-5", 4), ("--global-batch", "0", 1), ("--micro-batch-size", "0", 1),
    ("--engine-tp", "0", 1),
])
def test_plan_refuses_a_workload_that_is_no_workload(tmp_path, capsys, option, value, least):
    folder = _model(tmp_path, LLAMA)
    assert main(["plan", "--model", folder, "--tp", "1", "--pp", "1", "--dp", "1", "--gpu-memory-gib", "80",
                 option, value]) == 2
    assert _one_line(capsys, "hacrl plan: ") == f"hacrl plan: {option}={value}: must be >= {least}"
