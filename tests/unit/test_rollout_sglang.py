"""SGLangEngine against a fake SGLang HTTP server on 127.0.0.1.

A real SGLang server cannot run here: it needs ``sgl_kernel``, whose CPU build is not on PyPI
(docs/measured.md §3). The fake server below answers /health, /generate,
/update_weights_from_disk and /update_weights_from_tensor with SGLang's JSON shapes (prompt-major
B·n replies, output_ids that include the matched eos, finish_reason {"type", "matched"}) and is
backed by a real tiny HF model, so the client's results can be compared with HFEngine's.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import HFEngine, RolloutEngine, SamplingParams, SGLangEngine, SGLangError
from hacrl_megatron.rollout.sglang_engine import deserialize_named_tensors, serialize_named_tensors
from tests.unit.test_rollout_hf import QUESTIONS, tiny_llama

torch.set_num_threads(1)


class FakeSGLang(BaseHTTPRequestHandler):
    backend: HFEngine
    log: list

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(200, {}) if self.path == "/health" else self._reply(404, {"error": self.path})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.log.append((self.path, req))
        handler = {"/generate": self._generate, "/update_weights_from_disk": self._disk,
                   "/update_weights_from_tensor": self._tensor}.get(self.path)
        if handler is None:
            return self._reply(404, {"error": self.path})
        code, obj = handler(req)
        self._reply(code, obj)

    def _generate(self, req):
        sp = dict(req["sampling_params"])
        if sp.get("max_new_tokens", 1) > 1000:
            return 400, {"error": {"message": "max_new_tokens too large"}}
        params = SamplingParams(n=sp["n"], temperature=sp["temperature"], top_p=sp["top_p"],
                                max_new_tokens=sp["max_new_tokens"],
                                stop_token_ids=tuple(sp.get("stop_token_ids", ())), seed=sp.get("sampling_seed"))
        out = []
        for group in self.backend.generate(req["input_ids"], params):
            for c in group:
                ids = list(c.token_ids)
                if c.finish_reason == "length":
                    finish = {"type": "length", "length": len(ids)}
                else:  # SGLang keeps the matched stop token in output_ids
                    matched = self.backend.eos_id if c.finish_reason == "eos" else sp["stop_token_ids"][0]
                    ids.append(matched)
                    finish = {"type": "stop", "matched": matched}
                out.append({"text": c.text, "output_ids": ids,
                            "meta_info": {"finish_reason": finish, "completion_tokens": len(ids)}})
        return 200, out

    def _disk(self, req):
        from safetensors.torch import load_file

        state = load_file(f"{req['model_path']}/model.safetensors")
        try:
            self.backend.load_weights(state.items())
        except (KeyError, ValueError) as e:
            return 200, {"success": False, "message": str(e)}
        return 200, {"success": True, "message": "ok"}

    def _tensor(self, req):
        self.backend.load_weights(deserialize_named_tensors(req["serialized_named_tensors"][0]))
        return 200, {"success": True, "message": "ok"}


@pytest.fixture()
def server(tmp_path):
    tok = load_tokenizer("char", tmp_path / "tok")
    handler = type("Handler", (FakeSGLang,), {"backend": HFEngine(tiny_llama(len(tok)), tok), "log": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler, tok
    httpd.shutdown()
    httpd.server_close()


def prompts(tok):
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def test_generate_matches_hf_engine(server, tmp_path):
    url, handler, tok = server
    eng = SGLangEngine(url, eos_token_id=tok.eos_token_id, tokenizer=tok, sync_dir=tmp_path / "sync")
    assert isinstance(eng, RolloutEngine) and eng.health()
    reference = HFEngine(tiny_llama(len(tok)), tok)
    for params in (SamplingParams(temperature=0, max_new_tokens=8),
                   SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)):
        assert eng.generate(prompts(tok), params) == reference.generate(prompts(tok), params)
    sent = handler.log[-1][1]
    assert sent["input_ids"] == prompts(tok)
    assert sent["sampling_params"]["n"] == 3 and sent["sampling_params"]["sampling_seed"] == 5
    assert eng.stats()["sequences"] == 4 + 12


def test_finish_reasons_strip_matched_ids(server, tmp_path):
    url, handler, tok = server
    eng = SGLangEngine(url, eos_token_id=tok.eos_token_id, sync_dir=tmp_path)
    greedy = eng.generate(prompts(tok)[:1], SamplingParams(temperature=0, max_new_tokens=8))[0][0]
    stop_id = greedy.token_ids[2]
    assert stop_id not in greedy.token_ids[:2]
    c = eng.generate(prompts(tok)[:1], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop_id,)))
    assert (c[0][0].token_ids, c[0][0].finish_reason) == (greedy.token_ids[:2], "stop")
    parsed = eng._completion({"output_ids": [7, 8, 0], "text": "ab",
                              "meta_info": {"finish_reason": {"type": "stop", "matched": 0}}}, SamplingParams())
    assert (parsed.token_ids, parsed.text, parsed.finish_reason) == ((7, 8), "ab", "eos")
    with pytest.raises(SGLangError, match="aborted"):
        eng._completion({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}},
                        SamplingParams())


@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_weight_sync_changes_server_outputs(server, tmp_path, mode):
    url, handler, tok = server
    eng = SGLangEngine(url, eos_token_id=tok.eos_token_id, tokenizer=tok, weight_sync=mode,
                       sync_dir=tmp_path / "sync")
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before = eng.generate(prompts(tok), params)
    other = tiny_llama(len(tok), seed=1)
    assert eng.load_weights(other.state_dict().items()) == len(other.state_dict())
    after = eng.generate(prompts(tok), params)
    assert after != before and after == HFEngine(other, tok).generate(prompts(tok), params)
    path, req = handler.log[-2]
    assert path == f"/update_weights_from_{mode}" and req["weight_version"] == "1"
    if mode == "disk":
        assert req["model_path"] == str(tmp_path / "sync")


def test_server_errors_are_reported(server, tmp_path):
    url, handler, tok = server
    eng = SGLangEngine(url, eos_token_id=0, sync_dir=tmp_path / "sync")
    with pytest.raises(SGLangError, match="HTTP 400: .*max_new_tokens too large"):
        eng.generate(prompts(tok), SamplingParams(max_new_tokens=5000))
    with pytest.raises(SGLangError, match="update_weights_from_disk failed: .*'bogus.weight'"):
        eng.load_weights([("bogus.weight", torch.zeros(2))])
    dead = SGLangEngine("http://127.0.0.1:9", eos_token_id=0, sync_dir=tmp_path, timeout=2)
    assert not dead.health()
    with pytest.raises(SGLangError, match="not healthy after"):
        dead.wait_until_healthy(timeout=0.2, interval=0.1)
    with pytest.raises(ValueError, match="needs sync_dir"):
        SGLangEngine(url, eos_token_id=0)
    with pytest.raises(ValueError, match="weight_sync='nccl'"):
        SGLangEngine(url, eos_token_id=0, weight_sync="nccl")


def test_tensor_payload_round_trip():
    named = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(4))]
    back = deserialize_named_tensors(serialize_named_tensors(named))
    assert [n for n, _ in back] == ["a.weight", "b.bias"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named, back, strict=True))
