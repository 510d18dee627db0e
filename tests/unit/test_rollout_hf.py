"""HFEngine: batching, seeds, finish reasons, stop strings, weight loading, sequence log-probs."""

from __future__ import annotations

import copy

import pytest
import torch

from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import Completion, HFEngine, RolloutEngine, SamplingParams, hf_sequence_logprob

torch.set_num_threads(1)
QUESTIONS = ["Q: 3+4=? A:", "Q: 12+30=? A:", "Q: 7+1=? A:", "Q: 99+1=? A:"]


def tiny_llama(vocab: int, seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      tie_word_embeddings=tie, eos_token_id=0, pad_token_id=1, bos_token_id=None,
                      initializer_range=0.5)  # large init: varied, non-repeating greedy outputs
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def engine(tok):
    return HFEngine(tiny_llama(len(tok)), tok)


def prompts(tok):
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def test_protocol_and_shapes(engine, tok):
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts(tok), SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=0))
    assert [len(o) for o in out] == [3, 3, 3, 3]
    for group in out:
        for c in group:
            assert isinstance(c, Completion) and len(c.token_ids) <= 6
            assert c.text == tok.decode(list(c.token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stats = engine.stats()
    assert stats["sequences"] == 12 and stats["tokens"] >= sum(len(c.token_ids) for g in out for c in g)
    assert stats["tokens_per_s"] > 0


def tiny_qwen3(vocab: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, intermediate_size=96, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=1, bos_token_id=None,
                      initializer_range=0.5)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def test_greedy_batched_equals_unbatched_qwen3(tok):
    engine = HFEngine(tiny_qwen3(len(tok)), tok)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert engine.generate(prompts(tok), params) == [engine.generate([p], params)[0] for p in prompts(tok)]


def test_greedy_batched_equals_unbatched(engine, tok):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    batched = engine.generate(prompts(tok), params)  # left-padded to the longest prompt
    single = [engine.generate([p], params)[0] for p in prompts(tok)]
    assert batched == single
    assert len({c[0].token_ids for c in batched}) == len(QUESTIONS)  # outputs differ by prompt
    chunked = HFEngine(engine.model, tok, max_batch_size=1).generate(prompts(tok), params)
    assert chunked == batched


def test_seeds_reproduce(engine, tok):
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=7)
    torch.manual_seed(123)
    a = engine.generate(prompts(tok), p)
    state_after = torch.random.get_rng_state()
    b = engine.generate(prompts(tok), p)
    assert a == b
    assert torch.equal(torch.random.get_rng_state(), state_after)  # the caller's RNG is untouched
    c = engine.generate(prompts(tok), SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=8))
    assert a != c
    assert len({x.token_ids for x in a[0]}) > 1  # the n samples of one prompt differ


def test_finish_reasons(engine, tok):
    p = prompts(tok)[:1]
    greedy = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8))[0][0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    third = greedy.token_ids[2]
    assert third not in greedy.token_ids[:2]
    # Make the greedy path's third token the eos of a tokenizer copy: the response must stop
    # right before it, without the eos in token_ids.
    tok2 = copy.deepcopy(tok)
    tok2.eos_token = tok.convert_ids_to_tokens(third)
    eng2 = HFEngine(engine.model, tok2)
    c = eng2.generate(p, SamplingParams(temperature=0, max_new_tokens=8))[0][0]
    assert (c.token_ids, c.finish_reason) == (greedy.token_ids[:2], "eos")
    # the same token as an extra stop id gives "stop"
    s = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(third,)))[0][0]
    assert (s.token_ids, s.finish_reason) == (greedy.token_ids[:2], "stop")
    # a stop string is kept in the text and the ids
    stop_text = tok.decode([greedy.token_ids[3]])
    assert stop_text not in greedy.text[: len(tok.decode(list(greedy.token_ids[:3])))]
    st = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8, stop=(stop_text,)))[0][0]
    assert st.finish_reason == "stop" and st.token_ids == greedy.token_ids[:4] and st.text.endswith(stop_text)


def test_load_weights_changes_outputs_and_validates(tok):
    eng = HFEngine(tiny_llama(len(tok), seed=0), tok)
    other = tiny_llama(len(tok), seed=1)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    before = eng.generate(prompts(tok), params)
    n = eng.load_weights(other.state_dict().items())  # HF names, incl. the tied lm_head.weight
    assert n == len(other.state_dict())
    after = eng.generate(prompts(tok), params)
    assert after != before
    assert after == HFEngine(other, tok).generate(prompts(tok), params)
    for name, t in other.state_dict().items():
        assert torch.equal(eng.model.state_dict()[name], t), name
    with pytest.raises(KeyError, match="'model.layers.9.mlp.up_proj.weight'"):
        eng.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), the model expects \(32,\)"):
        eng.load_weights([("model.norm.weight", torch.zeros(3))])


def test_load_weights_tied_embeddings(tok):
    eng = HFEngine(tiny_llama(len(tok)), tok)
    emb = eng.model.model.embed_tokens.weight
    new = torch.randn_like(emb)
    eng.load_weights([("lm_head.weight", new)])
    assert torch.equal(emb, new) and torch.equal(eng.model.lm_head.weight, new)
    with pytest.raises(ValueError, match="tied"):
        eng.load_weights([("model.embed_tokens.weight", new), ("lm_head.weight", new + 1)])


def test_sequence_logprob_matches_stepwise_reference(engine, tok):
    prompt = prompts(tok)[1]
    resp = list(engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))[0][0].token_ids)
    for temp in (1.0, 0.7):
        ref = 0.0
        with torch.no_grad():
            for i, t in enumerate(resp):  # one forward per prefix: an independent computation
                logits = engine.model(input_ids=torch.tensor([prompt + resp[:i]])).logits[0, -1]
                ref += torch.log_softmax(logits / temp, -1)[t].item()
        assert hf_sequence_logprob(engine.model, prompt, resp, temp) == pytest.approx(ref, abs=1e-4)
    assert hf_sequence_logprob(engine.model, prompt, [], 1.0) == 0.0
    with pytest.raises(ValueError, match="temperature=0"):
        hf_sequence_logprob(engine.model, prompt, resp, 0)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="not one string"):
        SamplingParams(stop="x")
    with pytest.raises(ValueError, match="finish_reason='done'"):
        Completion(token_ids=(), text="", finish_reason="done")
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_generate_rejects_empty_prompt(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())


def test_model_generation_config_cannot_reshape_sampling(tok):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    plain = HFEngine(tiny_llama(len(tok)), tok).generate(prompts(tok), params)
    model = tiny_llama(len(tok))
    # what a hub checkpoint may ship; the engine must sample from the raw policy regardless
    model.generation_config.repetition_penalty = 100.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.min_new_tokens = 5
    assert HFEngine(model, tok).generate(prompts(tok), params) == plain
    torch.manual_seed(0)
    sampled_plain = HFEngine(tiny_llama(len(tok)), tok).generate(prompts(tok), SamplingParams(n=2, seed=3))
    model.generation_config.top_k = 1
    model.generation_config.top_p = 0.1
    assert HFEngine(model, tok).generate(prompts(tok), SamplingParams(n=2, seed=3)) == sampled_plain
