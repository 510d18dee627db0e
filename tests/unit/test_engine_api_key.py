"""``rollout.sglang.api_key_file``: the servers start with SGLang's API key and every client request
carries the bearer key (the stand-in server enforces it as SGLang's middleware does: /health open,
every other route 401 without the key). The key is never on a command line (a private ``--config``
YAML file, removed once the server started) nor in a file of the run folder or in any output: SGLang
prints its arguments, the key among them, and the log gets them redacted; logs are created 0600."""

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


def test_the_key_travels_in_a_private_config_file_custom_commands_too(tmp_path):
    key = "Key-NEVER-in-a-path-1"  # upper case and dashes: no random temporary folder name contains it
    server = SGLangServer(tmp_path, port=30000, api_key=key)
    line = server.command_line()
    assert line[-2] == "--config" and key not in " ".join(line)
    key_file = Path(line[-1])
    assert key_file.suffix == ".yaml" and tmp_path not in key_file.parents  # SGLang wants .yaml; not in the run
    assert json.loads(key_file.read_text()) == {"api-key": key}  # JSON is YAML; SGLang makes it --api-key
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.parent.stat().st_mode & 0o777 == 0o700
    server._key_config.discard()
    assert not key_file.parent.exists()
    custom = SGLangServer(None, port=30001, command=["srun", "launch", "{port}"], api_key="k2")
    assert custom.command_line()[:4] == ["srun", "launch", "30001", "--config"]
    custom._key_config.discard()
    assert "--config" not in SGLangServer(tmp_path, port=30002).command_line()
    with pytest.raises(ValueError, match="its own --config cannot carry it"):
        SGLangServer(tmp_path, extra_args=["--config", "mine.yaml"], api_key="k3")


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
        assert client.server._key_config.path is None  # read at start-up, then removed
    finally:
        client.close()
    log = tmp_path / "engines" / "server0.log"
    assert "server_args=" in log.read_text() and "<api-key redacted>" in log.read_text()  # printed, redacted
    assert log.stat().st_mode & 0o777 == 0o600
    leaks = [p for p in (tmp_path / "engines").rglob("*") if p.is_file() and b"s3cret" in p.read_bytes()]
    assert leaks == []  # no file the run wrote holds the key


def test_a_training_run_with_a_key_leaves_it_in_no_file_and_no_output(tmp_path, capfd):
    """One step of the loop (two agents, stand-in servers, distributed sync inside the session) with a key:
    the run folder holds no file with the key, nothing printed shows it, and the logs are 0600."""
    from hacrl_megatron.reward.pool import VerifierPool
    from hacrl_megatron.trainer import loop
    from tests.e2e.test_trainer import parity_reward

    secret = "k3y-" + "x9" * 12
    (tmp_path / "key").write_text(secret + "\n")
    command = [sys.executable, str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}"]
    exp = tiny_exp(tmp_path)
    exp = validate(dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=1), rollout=dataclasses.replace(
        exp.rollout, engine="sglang", weight_sync="distributed",
        sglang=dataclasses.replace(exp.rollout.sglang, command=command, api_key_file=str(tmp_path / "key")))))
    run = loop.setup(exp)
    try:
        run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
        metrics = loop.train_step(run)
        assert all(metrics[f"{rt.name}/sync_logp_diff"] < 1e-3 for rt in run.runtimes)
    finally:
        for rt in run.runtimes:
            rt.close()
    out, err = capfd.readouterr()
    assert secret not in out + err
    files = [p for p in Path(exp.output_dir).rglob("*") if p.is_file() and not p.is_symlink()]
    logs = [p for p in files if p.name.startswith("server") and p.suffix == ".log"]
    assert len(logs) == 2 and all(p.stat().st_mode & 0o777 == 0o600 for p in logs)
    assert all("<api-key redacted>" in p.read_text() for p in logs)  # the stand-in printed it, as SGLang does
    assert [p for p in files if secret.encode() in p.read_bytes()] == []
