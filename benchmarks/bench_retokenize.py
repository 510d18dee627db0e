"""The controller's re-tokenisation cost per response token (the planner's ``retokenize_us_per_token``).

    RAYON_NUM_THREADS=1 python benchmarks/bench_retokenize.py [--vocab 32000 48000] [--responses 256]
                                                             [--tokens 2048] [--repeats 3]

Two byte-level BPE tokenizers of different vocabulary sizes are trained on the same English and
Python text (the standard library's sources and docstrings: no download), a source agent's
responses of about ``--tokens`` tokens each are cut from held-out text, and
:meth:`hacrl_megatron.exchange.retokenize.Exchange.views` builds the learner's views of them
(decode, re-encode and decode back: what the loop does per cross response and learner). Prints the
median seconds per call and microseconds per source token; ``RAYON_NUM_THREADS`` sets the Rust
tokenizers' threads (the planner states one thread's cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hacrl_megatron.exchange.records import Trajectory
from hacrl_megatron.exchange.retokenize import Exchange


def corpus(limit_bytes: int) -> tuple[list[str], str]:
    """Training lines and held-out text from the interpreter's standard library sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text, size = [], 0
    for f in files:
        body = f.read_text(errors="ignore")
        text.append(body)
        size += len(body)
        if size > limit_bytes:
            break
    split = int(len(text) * 0.8)
    return text[:split], "\n".join(text[split:])


def bpe(lines: list[str], vocab: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs=2, default=[32000, 48000])
    ap.add_argument("--responses", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    args = ap.parse_args()
    train, held = corpus(int(args.corpus_mb * 1e6))
    src, dst = bpe(train, args.vocab[0]), bpe(train, args.vocab[1])
    ids = src(held, add_special_tokens=False)["input_ids"]
    chunks = [ids[(i * args.tokens) % max(1, len(ids) - args.tokens):][:args.tokens] for i in range(args.responses)]
    trajs = [Trajectory(prompt_id="p", source="src", prompt_text="q", response_text=src.decode(c),
                        token_ids=tuple(c), finish_reason="length", reward=0.0, source_len=len(c)) for c in chunks]
    ex = Exchange({"src": src, "dst": dst}, max_prompt_len=16, max_response_len=args.tokens * 4)
    prompt = {"p": dst("q", add_special_tokens=False)["input_ids"]}
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ex.views("dst", trajs, prompt, record_stats=False)
        times.append(time.perf_counter() - start)
    total = sum(len(c) for c in chunks)
    med = statistics.median(times)
    print(json.dumps({"responses": len(chunks), "source_tokens": total, "vocab": args.vocab,
                      "seconds_median": round(med, 4), "seconds": [round(t, 4) for t in times],
                      "us_per_source_token": round(med / total * 1e6, 3)}))


if __name__ == "__main__":
    main()
