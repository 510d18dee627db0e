"""What our clients rely on from an engine server, written once and run against every target (conftest.py):
the SGLang stand-in (default tests), the real SGLang server on CPU and, for the routes both have, the real
vLLM server. Where the stand-in and a real server differ, the stand-in is wrong.

Each test first loads the weights it needs (disk), so the tests do not depend on their order. Checked:
batched generation with n samples per prompt and distinct seeds, the eos / stop / length endings,
greedy equal to the trainer's model; input log-probs per token equal to the trainer's (fp32, 1e-5);
a disk update, then log-probs on the new weights and the reported weight version; a gloo broadcast
inside the weight-update session, and a push outside it refused; release / resume; the API key (401
without it, /health open); a server killed in the middle of a generation, restarted by the pool,
resynced, the generation complete; the reply shapes of every route the client calls.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from hacrl_megatron.rollout import EnginePool, HFEngine, SamplingParams
from hacrl_megatron.rollout.sglang_engine import SGLangEngine, SGLangError
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.distributed import DistributedTransport
from tests.conformance.conftest import API_KEY, hf_model
from tests.fixtures.vllm_env import write_tiny_llama

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
QUESTIONS = ["Q: 3+4=? A:", "Q: 12+30=? A:", "Q: 7+1=? A:"]
PER_TOKEN = 1e-5  # fp32 engine vs fp32 trainer, nats per token (measured: ~1e-7 SGLang, ~3e-7 vLLM)
VERSION = iter(range(100, 10_000))  # weight versions: each load a new one


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, tok) -> Path:
    path = tmp_path_factory.mktemp("other_llama")
    write_tiny_llama(path, tok, seed=1)
    return path


def prompts(tok) -> list[list[int]]:
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def load(client, folder: Path) -> None:
    client.update_weights_from_disk(str(folder), next(VERSION))


def trainer_token_logprobs(model, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = start .. len(ids) - 1 under the HF model (the trainer's network)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(start, len(ids))]


def xfail_on_vllm(request, target, why: str) -> None:
    """Mark this test an expected failure on the vLLM target only (strict: a fix makes it fail until removed)."""
    if target.kind == "vllm":
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))


def engine_token_logprobs(client, prompt: list[int], response: list[int]) -> list[float]:
    """Per-token log-probs of ``response``: SGLang's ``input_token_logprobs`` (the request the client's
    scoring sends); vLLM: differences of the client's prefix sums (fp32 sums: ~1e-6 of rounding)."""
    if isinstance(client, SGLangEngine):
        reply = client.post("/generate", {"input_ids": prompt + response, "return_logprob": True,
                                          "logprob_start_len": len(prompt) - 1,
                                          "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        entries = reply["meta_info"]["input_token_logprobs"][1:]
        assert [e[1] for e in entries] == response
        return [float(e[0]) for e in entries]
    sums = [0.0] + [client.sequence_logprob(prompt, response[: k + 1]) for k in range(len(response))]
    return [b - a for a, b in zip(sums, sums[1:])]


def test_generate_batched_n_samples_and_the_three_endings(target, tok, model_dir):
    client = target.client(tok)
    load(client, model_dir)
    out = client.generate(prompts(tok), SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3))
    assert [len(g) for g in out] == [4] * len(QUESTIONS)
    # a random model samples its eos (1 of 99 ids) about once in 99 draws at temperature 1: over 72 draws a
    # sample may end early (seen with vLLM's sampler), so each ends at the length or at an eos it did not keep
    samples = [c for g in out for c in g]
    assert all((len(c.token_ids) == 6 and c.finish_reason == "length")
               or (c.finish_reason == "eos" and len(c.token_ids) < 6 and tok.eos_token_id not in c.token_ids)
               for c in samples), [(c.token_ids, c.finish_reason) for c in samples]
    assert sum(c.finish_reason == "length" for c in samples) >= len(samples) // 2
    assert all(c.text == tok.decode(c.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
               for g in out for c in g)
    assert len({c.token_ids for g in out for c in g}) >= 10  # 12 seeded samples of 6 tokens: (nearly) all distinct
    greedy = client.generate(prompts(tok), SamplingParams(n=1, temperature=0, max_new_tokens=8))
    first = greedy[0][0].token_ids
    stop_id = client.generate([prompts(tok)[0]], SamplingParams(n=1, temperature=0, max_new_tokens=8,
                                                                stop_token_ids=(first[2],)))[0][0]
    cut = first.index(first[2]) + 1  # generation ends at the first occurrence; the stop id is reported, not kept
    assert stop_id.finish_reason == "stop" and stop_id.token_ids == first[: cut - 1]
    text = greedy[0][0].text
    stop_text = client.generate([prompts(tok)[0]], SamplingParams(n=1, temperature=0, max_new_tokens=8,
                                                                  stop=(text[1:3],)))[0][0]
    assert stop_text.finish_reason == "stop" and stop_text.text.endswith(text[1:3])  # the stop string is kept
    # eos: near-uniform sampling (temperature 2, vLLM's largest) over 99 tokens, 16 × 100 draws: the random
    # model samples its eos about once in 99 draws (measured), so P(no eos at all) ≈ (98/99)**1600 < 1e-6
    hot = client.generate(prompts(tok)[:2], SamplingParams(n=8, temperature=2.0, max_new_tokens=100, seed=11))
    ends = [c for g in hot for c in g if c.finish_reason == "eos"]
    assert ends and all(tok.eos_token_id not in c.token_ids and len(c.token_ids) < 100 for c in ends)


def test_greedy_generation_equals_the_trainer_model(target, tok, model_dir):
    client = target.client(tok)
    load(client, model_dir)
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    expected = HFEngine(hf_model(model_dir), tok).generate(prompts(tok), greedy)
    assert client.generate(prompts(tok), greedy) == expected
    assert client.generate(prompts(tok), greedy) == expected  # and again: greedy is reproducible


def test_input_logprobs_equal_the_trainers_per_token(target, tok, model_dir):
    client = target.client(tok)
    load(client, model_dir)
    model = hf_model(model_dir)
    gaps = []
    for ids in prompts(tok):
        prompt, response = ids[:4], ids[4:]
        want = trainer_token_logprobs(model, ids, len(prompt))
        got = engine_token_logprobs(client, prompt, response)
        gaps += [abs(a - b) for a, b in zip(got, want)]
        assert client.sequence_logprob(prompt, response) == pytest.approx(sum(want), abs=PER_TOKEN * len(response))
    print(f"\n{target.kind}: input log-probs vs the trainer: max |diff| {max(gaps):.2e} per token over "
          f"{len(gaps)} tokens")
    assert max(gaps) <= PER_TOKEN


def test_the_vocabularys_last_token_is_scored_like_any_other(target, tok, model_dir):
    """SGLang reports the id vocab_size - 1 as 0 in input_token_logprobs (found by hacrl train with the
    qwen3 agent's pair tokenizer); its log-prob is still the sent token's, and the client scores it."""
    client = target.client(tok)
    load(client, model_dir)
    model = hf_model(model_dir)
    top = model.config.vocab_size - 1
    ids = prompts(tok)[0][:5] + [top, 7, top]
    want = trainer_token_logprobs(model, ids, 5)
    assert client.sequence_logprob(ids[:5], ids[5:]) == pytest.approx(sum(want), abs=PER_TOKEN * 3)
    if target.speaks_sglang:
        reply = client.post("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 4,
                                          "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        assert [e[1] for e in reply["meta_info"]["input_token_logprobs"]] == [ids[4], 0, 7, 0]


def test_disk_update_then_logprobs_on_the_new_weights(request, target, tok, model_dir, other_dir):
    xfail_on_vllm(request, target, "vLLM target: after a disk update from another folder its log-probs are "
                  "not the new weights' (measured -54.76 vs -49.47); not diagnosed yet")
    client = target.client(tok)
    load(client, model_dir)
    ids = prompts(tok)[1]
    before = client.sequence_logprob(ids[:4], ids[4:])
    version = next(VERSION)
    client.update_weights_from_disk(str(other_dir), version)
    want = trainer_token_logprobs(hf_model(other_dir), ids, 4)
    after = client.sequence_logprob(ids[:4], ids[4:])
    assert abs(after - before) > 1e-2 and after == pytest.approx(sum(want), abs=PER_TOKEN * len(want))
    assert client.server_weight_version() == str(version)


def test_distributed_push_over_gloo_inside_the_session_and_refused_outside(target, tok, model_dir, other_dir):
    target.only_sglang()
    client = target.client(tok)
    load(client, model_dir)
    transport = DistributedTransport(40_000, backend="gloo", group_name="conformance", timeout_s=300)
    try:
        t0 = time.perf_counter()
        other = dict(hf_model(other_dir).state_dict())
        assert transport.push([client], iter(other.items()), version=next(VERSION)) == len(other)
        seconds = time.perf_counter() - t0
    finally:
        transport.close()
    ids = prompts(tok)[2]
    want = trainer_token_logprobs(hf_model(other_dir), ids, 4)
    assert client.sequence_logprob(ids[:4], ids[4:]) == pytest.approx(sum(want), abs=PER_TOKEN * len(want))
    print(f"\n{target.kind}: gloo push of {len(other)} tensors in {transport.buckets_sent} buckets: {seconds:.2f} s")
    assert client.has_weight_session()  # 0.5.23: a push outside the session is refused before any broadcast
    with pytest.raises(SGLangError, match=r"HTTP 400: .*update_weights_from_distributed must run between "
                                          r"begin_weight_update\(\) and end_weight_update\(\)"):
        client.update_weights_from_distributed(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]],
                                               group_name="no-such-group", flush_cache=False, version=1)
    with pytest.raises(SGLangError, match=r"HTTP 400: .*no weight-update session is open"):
        client.post("/end_weight_update", {})


def test_release_and_resume_then_generation_goes_on(target, tok, model_dir):
    target.only_sglang()
    client = target.client(tok)
    load(client, model_dir)
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    before = client.generate(prompts(tok), greedy)
    assert client.post("/release_memory_occupation", {}) is None  # SGLang answers null
    assert client.post("/resume_memory_occupation", {}) is None
    client.release_memory(["kv_cache"])
    client.resume_memory(["kv_cache"])
    assert client.generate(prompts(tok), greedy) == before


def test_the_api_key_is_required_and_health_stays_open(target, tok):
    target.only_sglang()
    import json
    import urllib.error
    import urllib.request

    def status(path: str, key: str | None) -> int:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        data = None if path == "/health" else json.dumps({"input_ids": [5, 6], "sampling_params":
                                                          {"max_new_tokens": 1}}).encode()
        req = urllib.request.Request(target.server.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status("/health", None) == 200
    assert status("/generate", None) == 401 and status("/generate", "wrong") == 401
    assert status("/generate", API_KEY) == 200


def kill_soon(target, delay_s: float) -> threading.Timer | None:
    """Kill the target's server in the middle of the next generation (the stand-in: at its next /generate;
    a real server: SIGKILL to its whole process group ``delay_s`` after now; the timer is returned)."""
    if target.kind == "stand-in":
        target.server.die_after_generates = target.server.generates
        return None
    pgid = target.server.process.pid  # the leader of the server's own session (servers.launch)
    timer = threading.Timer(delay_s, lambda: os.killpg(pgid, signal.SIGKILL))
    timer.start()
    return timer


def test_a_server_killed_mid_generation_is_restarted_resynced_and_the_generation_completes(
        target, tok, model_dir, other_dir, tmp_path):
    client = target.client(tok)
    pool = EnginePool([client], DiskTransport(tmp_path / "sync", model_dir), name="a")
    pool.sync_from(lambda: iter(hf_model(other_dir).state_dict().items()))  # weights only a resync restores
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=100)
    expected = HFEngine(hf_model(other_dir), tok).generate(prompts(tok), greedy)
    timer = kill_soon(target, delay_s=0.5)
    t0 = time.perf_counter()
    out = pool.generate(prompts(tok), greedy)
    if timer is not None:
        timer.join()  # the kill has landed by now
        if client.restarts == 0 and target.server.restarts == 0:
            # a fast server answered before the kill: the next generation meets the dead server instead
            out = pool.generate(prompts(tok), greedy)
    seconds = time.perf_counter() - t0
    assert client.restarts >= 1 or target.server.restarts >= 1
    assert out == expected  # completed on the restarted server, on the synced weights
    assert target.server.is_running() and client.health()
    print(f"\n{target.kind}: killed mid-generation, restarted, resynced and completed in {seconds:.1f} s")


def test_reply_shapes_of_every_route_the_client_calls(target, tok, model_dir):
    target.only_sglang()
    client = target.client(tok)
    load(client, model_dir)
    get = lambda path: client._request(path, None, "GET")  # noqa: E731
    assert client.health()
    info = get("/server_info")
    assert isinstance(info["version"], str) and client.server_version() == info["version"]
    assert isinstance(get("/model_info")["weight_version"], str)
    if info["version"].startswith("0.5.23"):
        with pytest.raises(SGLangError, match=r"/get_weight_version -> HTTP 404: \{\"detail\": ?\"Not Found\"\}"):
            get("/get_weight_version")
    ids = prompts(tok)[0]
    reply = client.post("/generate", {"input_ids": [ids, ids], "sampling_params": [
        {"n": 1, "temperature": 0.0, "max_new_tokens": 3}, {"n": 1, "temperature": 1.0, "max_new_tokens": 3,
                                                           "sampling_seed": 5}]})
    assert isinstance(reply, list) and len(reply) == 2
    for item in reply:
        assert isinstance(item["text"], str) and all(isinstance(t, int) for t in item["output_ids"])
        meta = item["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["completion_tokens"] == 3
        assert meta["prompt_tokens"] == len(ids) and isinstance(meta["weight_version"], str)
    scored = client.post("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 3,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    entries = scored["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[3:] and entries[0][0] is None  # null at logprob_start_len (> 0)
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in entries[1:])
    assert scored["meta_info"]["output_token_logprobs"][0][1] == scored["output_ids"][0]
    flushed = client.post("/flush_cache", None)
    assert isinstance(flushed, str) and flushed.startswith("Cache flushed")  # plain text, not JSON
    client.flush_cache()
    assert client.post("/release_memory_occupation", {}) is None and client.post("/resume_memory_occupation", {}) is None
    updated = client.post("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "shape"})
    assert updated["success"] is True and isinstance(updated["message"], str)
    for route in ("/begin_weight_update", "/end_weight_update"):
        assert client.post(route, {}) == {"success": True, "message": "Success"}
