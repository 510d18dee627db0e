"""Each ``rollout.eos_mode`` (docs/algorithm.md §6) on self and cross responses, against token ids written
out by hand for two tiny tokenizers with known vocabularies.

Agent "a" spells "12=3" as 1 2 = 3 → ids [1, 2, 3, 4] and ends with "<e>" (id 0); agent "b" merges
"12" → ids [5, 2, 1], ends with "</s>" (id 0) and spells the text "<e>" as [6, 7, 8].
"""

from __future__ import annotations

import pytest

from hacrl_megatron.exchange import Exchange, Trajectory
from hacrl_megatron.rollout.types import Completion

A_RESPONSE = (1, 2, 3, 4)  # "12=3" in a's tokens
B_REENCODED = [5, 2, 1]  # "12=3" in b's tokens
A_EOS, B_EOS = 0, 0
A_EOS_AS_B_TEXT = [6, 7, 8]  # "<e>" as ordinary text for b

EXPECTED = {  # mode -> (a's own view, b's view of a's response), both when a stopped by itself
    "learner_eos": ([*A_RESPONSE, A_EOS], [*B_REENCODED, B_EOS]),
    "source_eos_text": ([*A_RESPONSE, A_EOS], [*B_REENCODED, *A_EOS_AS_B_TEXT]),
    "no_eos": ([*A_RESPONSE, A_EOS], B_REENCODED),
    "strip_all": (list(A_RESPONSE), B_REENCODED),
}


def tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], eos: str):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([eos])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


@pytest.fixture(scope="module")
def toks():
    return {"a": tokenizer({"<e>": 0, "1": 1, "2": 2, "=": 3, "3": 4}, [], "<e>"),
            "b": tokenizer({"</s>": 0, "3": 1, "=": 2, "2": 3, "1": 4, "12": 5, "<": 6, "e": 7, ">": 8},
                           [("1", "2")], "</s>")}


def views(toks, mode: str, finish: str) -> tuple[list[int], list[int]]:
    traj = Trajectory.from_completion(Completion(token_ids=A_RESPONSE, text="12=3", finish_reason=finish),
                                      prompt_id="p", source="a", prompt_text="q", reward=1.0)
    ex = Exchange(toks, eos_mode=mode, max_prompt_len=8, max_response_len=16)
    own = ex.views("a", [traj], {"p": [1]})[0]
    cross = ex.views("b", [traj], {"p": [4]})[0]
    return list(own.input_ids[own.prompt_len:]), list(cross.input_ids[cross.prompt_len:])


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_eos_mode_by_hand(toks, mode):
    assert views(toks, mode, "eos") == EXPECTED[mode]


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_a_truncated_response_never_gets_an_eos(toks, mode):
    assert views(toks, mode, "length") == (list(A_RESPONSE), B_REENCODED)
