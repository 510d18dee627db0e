"""``rollout.sglang.api_key_file``: the servers start with SGLang's ``--api-key`` and every client request
carries the bearer key (the stand-in server enforces it as SGLang's middleware does: /health open,
every other route 401 without the key)."""

from __future__ import annotations

import dataclasses
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hacrl_megatron.config import validate
from hacrl_megatron.exchange.tokenizers import load_tokenizer
from hacrl_megatron.rollout import SamplingParams
from hacrl_megatron.rollout.sglang_engine import SGLangEngine, SGLangError
from hacrl_megatron.rollout.sglang_server import SGLangServer, read_api_key, start_engines
from hacrl_megatron.trainer.runtime import load_hf_model
from tests.e2e.test_trainer import tiny_exp

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "fake_sglang_server.py"


def test_command_line_carries_the_key_custom_commands_too(tmp_path):
    assert SGLangServer(tmp_path, port=30000, api_key="k1").command_line()[-2:] == ["--api-key", "k1"]
    custom = SGLangServer(None, port=30001, command=["srun", "launch", "{port}"], api_key="k2")
    assert custom.command_line() == ["srun", "launch", "30001", "--api-key", "k2"]
    assert "--api-key" not in SGLangServer(tmp_path, port=30002).command_line()


def test_key_file_errors_name_the_field(tmp_path):
    assert read_api_key("", "rollout.sglang.api_key_file") is None
    with pytest.raises(ValueError, match=r"rollout.sglang.api_key_file='.*missing': cannot read"):
        read_api_key(str(tmp_path / "missing"), "rollout.sglang.api_key_file")
    (tmp_path / "empty").write_text("\n  \n")
    with pytest.raises(ValueError, match="rollout.sglang.api_key_file=.*first line is empty"):
        read_api_key(str(tmp_path / "empty"), "rollout.sglang.api_key_file")
    (tmp_path / "key").write_text("  s3cret  \nignored\n")
    assert read_api_key(str(tmp_path / "key"), "rollout.sglang.api_key_file") == "s3cret"


def raw(url: str, path: str, payload: dict | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_servers_started_from_the_config_refuse_requests_without_the_key(tmp_path):
    exp = tiny_exp(tmp_path)
    (tmp_path / "key").write_text("s3cret\n")
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}"]
    exp = validate(dataclasses.replace(exp, rollout=dataclasses.replace(
        exp.rollout, engine="sglang", weight_sync="disk",
        sglang=dataclasses.replace(exp.rollout.sglang, command=command, api_key_file=str(tmp_path / "key")))))
    cfg = exp.agents[0]
    tok = load_tokenizer(cfg.tokenizer)
    started = start_engines(exp, cfg, load_hf_model(cfg, len(tok), seed=0), tok, tmp_path / "engines")
    (client,) = started.clients
    try:
        assert client.api_key == "s3cret" and client.detached().api_key == "s3cret"
        url = client.base_url
        assert raw(url, "/health") == 200  # open, as SGLang's middleware leaves it
        assert raw(url, "/flush_cache", {}) == 401
        assert raw(url, "/flush_cache", {}, key="wrong") == 401
        prompt = list(tok("1+2=", add_special_tokens=False)["input_ids"])
        params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=0)
        out = client.generate([prompt], params)  # the client sends the key
        assert len(out) == 1 and len(out[0]) == 2
        keyless = SGLangEngine(url, eos_token_id=tok.eos_token_id, tokenizer=tok)
        with pytest.raises(SGLangError, match="HTTP 401"):
            keyless.generate([prompt], params)
    finally:
        client.close()
