"""SGLangEngine against the stand-in server of tests/fixtures/fake_sglang_server.py, for every
SGLang release whose request contract is in tests/fixtures/sglang_contract/.

The stand-in validates each payload against that release's request classes (an unknown or
mistyped field is an HTTP 400 naming it), models SGLang's seeded sampling, and is backed by a
real tiny HF model, so the client's results can be compared with HFEngine's. The real SGLang server
runs on CPU too (tests/conformance/, CI's SGLang step) and on GPU (tests/gpu/test_rollout_sglang_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import HFEngine, SamplingParams, SGLangEngine, SGLangError
from hacrl_megatron.rollout.sglang_engine import sample_seeds
from tests.fixtures.sglang_standin import StandIn
from tests.fixtures.sglang_validator import VERSIONS
from tests.unit.test_rollout_hf import QUESTIONS, tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


def start(tok, **kw) -> StandIn:
    server = StandIn(lambda: HFEngine(tiny_llama(len(tok)), tok), **kw)
    server.start()
    return server


def prompts(tok):
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


@pytest.mark.parametrize("version", VERSIONS)
def test_generate_matches_hf_engine_and_passes_the_contract(tok, version):
    server = start(tok, version=version)
    try:
        eng = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok)
        assert eng.health()
        reference = HFEngine(tiny_llama(len(tok)), tok)
        greedy = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(5,))
        assert eng.generate(prompts(tok), greedy) == reference.generate(prompts(tok), greedy)
        sampled = eng.generate(prompts(tok), SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5))
        assert [len(g) for g in sampled] == [3] * 4
        path, sent = server.log[-1]
        assert path == "/generate" and len(sent["input_ids"]) == len(sent["sampling_params"]) == 12
        assert sent["input_ids"][:3] == [prompts(tok)[0]] * 3  # one entry per sample, prompt-major
        assert {sp["n"] for sp in sent["sampling_params"]} == {1}
        assert [sp["sampling_seed"] for sp in sent["sampling_params"]] == sample_seeds(5, 12)
        assert eng.stats()["sequences"] == 4 + 12
        assert eng.sequence_logprob(prompts(tok)[0], [3, 4, 5]) == pytest.approx(
            reference.sequence_logprob(prompts(tok)[0], [3, 4, 5]), abs=1e-5)
    finally:
        server.stop()


def test_sample_seeds_are_distinct_and_reproducible():
    seeds = sample_seeds(7, 1000)
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seeds(7, 5) == seeds[:5] and not set(sample_seeds(8, 1000)) & set(seeds)
    assert sample_seeds(None, 3) != sample_seeds(None, 3)  # fresh random base per call


def test_group_samples_differ_under_seeded_sampling(tok):
    """SGLang with deterministic inference: one request with n = G and one seed gives G identical
    samples (the old client's payload, reproduced here); the client's one-entry-per-sample seeds
    give G different samples, reproducibly."""
    server = start(tok, deterministic=True)
    try:
        eng = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok)
        prompt, G = prompts(tok)[0], 6
        old_style = eng.post("/generate", {"input_ids": [prompt], "sampling_params": {
            "n": G, "temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 3}})
        assert len({tuple(item["output_ids"]) for item in old_style}) == 1  # the bug the old payload hit
        params = SamplingParams(n=G, temperature=1.0, max_new_tokens=12, seed=3)
        group = eng.generate([prompt], params)[0]
        assert len({c.token_ids for c in group}) == G
        assert eng.generate([prompt], params)[0] == group  # same seed, same samples
        assert eng.generate([prompt], SamplingParams(n=G, temperature=1.0, max_new_tokens=12, seed=4))[0] != group
    finally:
        server.stop()


def test_finish_reasons_strip_matched_ids(tok):
    server = start(tok)
    try:
        eng = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id)
        greedy = eng.generate(prompts(tok)[:1], SamplingParams(temperature=0, max_new_tokens=8))[0][0]
        stop_id = greedy.token_ids[2]
        assert stop_id not in greedy.token_ids[:2]
        c = eng.generate(prompts(tok)[:1], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop_id,)))
        assert (c[0][0].token_ids, c[0][0].finish_reason) == (greedy.token_ids[:2], "stop")
        parsed = eng._completion({"output_ids": [7, 8, 0], "text": "ab",
                                  "meta_info": {"finish_reason": {"type": "stop", "matched": 0}}})
        assert (parsed.token_ids, parsed.text, parsed.finish_reason) == ((7, 8), "ab", "eos")
        with pytest.raises(SGLangError, match="aborted"):
            eng._completion({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}})
    finally:
        server.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_stand_in_rejects_unknown_and_mistyped_fields(tok, version):
    server = start(tok, version=version)
    try:
        eng = SGLangEngine(server.base_url, eos_token_id=0, timeout=10)
        ids = prompts(tok)[0]
        with pytest.raises(SGLangError, match=r"HTTP 400: .*sampling_params: unknown field `max_new_token`"):
            eng.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_token": 4}})
        with pytest.raises(SGLangError, match=r"HTTP 400: .*sampling_params\[1\]\.temperature: expected float"):
            eng.post("/generate", {"input_ids": [ids, ids], "sampling_params": [{}, {"temperature": "hot"}]})
        with pytest.raises(SGLangError, match=r"HTTP 400: .*GenerateReqInput: unknown field `inputs_ids`"):
            eng.post("/generate", {"inputs_ids": ids})
        with pytest.raises(SGLangError, match=r"HTTP 400: .*missing required field `model_path`"):
            eng.post("/update_weights_from_disk", {"weight_version": "1"})
        with pytest.raises(SGLangError, match=r"HTTP 400: .*master_port: expected int"):
            eng.post("/init_weights_update_group", {"master_address": "x", "master_port": "1", "rank_offset": 1,
                                                    "world_size": 2})
        with pytest.raises(SGLangError, match="update_weight_from_disk -> HTTP 404: {\"detail\": \"Not Found\"}"):  # FastAPI
            eng.post("/update_weight_from_disk", {"model_path": "x"})
        with pytest.raises(SGLangError, match="HTTP 400: .*max_new_tokens too large"):
            eng.generate([ids], SamplingParams(max_new_tokens=5000))
    finally:
        server.stop()


def test_an_exception_inside_a_route_is_an_http_500_naming_it_and_the_server_serves_on(tok, capfd, monkeypatch):
    # as SGLang's FastAPI app: a route that raises answers 500 (the engine pool's fault path), never a dropped
    # connection (which the pool reports as a reset of a live server)
    def broken(*args, **kwargs):
        raise RuntimeError("backend broke")

    server = start(tok)
    try:
        eng = SGLangEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, timeout=10)
        greedy = SamplingParams(temperature=0, max_new_tokens=4)
        monkeypatch.setattr(server.handler.state.backend, "generate", broken)
        with pytest.raises(SGLangError, match=r"HTTP 500: .*stand-in internal error: RuntimeError: backend broke"):
            eng.generate(prompts(tok), greedy)
        assert "RuntimeError: backend broke" in capfd.readouterr().err  # the traceback, for the test's report
        monkeypatch.undo()
        assert eng.generate(prompts(tok), greedy) == HFEngine(tiny_llama(len(tok)), tok).generate(prompts(tok), greedy)
    finally:
        server.stop()


def test_memory_release_and_resume(tok):
    server = start(tok)
    try:
        eng = SGLangEngine(server.base_url, eos_token_id=0)
        eng.release_memory()
        with pytest.raises(SGLangError, match="HTTP 500: .*memory released"):
            eng.generate(prompts(tok)[:1], SamplingParams(temperature=0, max_new_tokens=2))
        eng.resume_memory(["weights"])
        eng.resume_memory(["kv_cache"])
        assert eng.generate(prompts(tok)[:1], SamplingParams(temperature=0, max_new_tokens=2))
        assert [p for p, _ in server.log[:3]] == ["/release_memory_occupation", "/generate",
                                                  "/resume_memory_occupation"]
        assert server.log[2][1] == {"tags": ["weights"]}
    finally:
        server.stop()


def test_unreachable_server():
    dead = SGLangEngine("http://127.0.0.1:9", eos_token_id=0, timeout=2)
    assert not dead.health() and not dead.alive()
    with pytest.raises(SGLangError, match="not healthy after"):
        dead.wait_until_healthy(timeout=0.2, interval=0.1)
    with pytest.raises(SGLangError, match="no server handle to restart"):
        dead.restart()
