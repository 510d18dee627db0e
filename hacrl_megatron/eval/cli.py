"""``hacrl eval``: evaluate one or more agents (HF model folders) on benchmarks; one table row each.

    hacrl eval --agent runs/demo/final/a --agent runs/demo/final/b --benchmarks addition gsm8k \\
        --data gsm8k=data/gsm8k/test.jsonl --max-new-tokens 16 --out runs/demo/eval

Paper protocol (docs/algorithm.md §9): ``--benchmarks math500 math gsm8k aime2025 amc23 minerva olympiadbench
--max-new-tokens 8192`` with greedy avg@1, plus ``--sample --k 30`` for AIME2025's best@30.
"""

from __future__ import annotations

import argparse
import logging

from hacrl_megatron.eval.evaluate import EvalSettings, markdown_table, write_results
from hacrl_megatron.eval.inputs import EvalInputError, check_agent_folder, check_eval_args
from hacrl_megatron.eval.run import EvalData, run_eval
from hacrl_megatron.outputs import check_dir, claim_output
from hacrl_megatron.paths import CACHE_ENV, default_cache_dir
from hacrl_megatron.reward.custom import custom_score_fn
from hacrl_megatron.reward.pool import VerifierPool

logger = logging.getLogger(__name__)


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--data {text!r}: expected NAME=PATH")
    name, path = text.split("=", 1)
    return name.strip(), path.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the ``hacrl eval`` flags on ``p``."""
    p.add_argument("--agent", action="append", required=True,
                   help="HF model folder (save_pretrained output) or 'smollm2'; repeat for several rows")
    p.add_argument("--name", action="append", default=None,
                   help="row name per --agent (default: the folder name)")
    p.add_argument("--tokenizer", action="append", default=None,
                   help="tokenizer per --agent (char | pair | smollm2 | folder); one value applies to all; "
                        "default: the agent folder's own tokenizer")
    p.add_argument("--benchmarks", nargs="+", required=True,
                   help="datasets (math math500 gsm8k aime2025 amc23 minerva olympiadbench) and/or "
                        "procedural tasks (addition arithmetic linear countdown)")
    p.add_argument("--data", action="append", type=_key_value, default=[], metavar="NAME=PATH",
                   help="local file or folder of a dataset benchmark (else $HACRL_DATA_DIR/NAME/)")
    p.add_argument("--k", type=int, default=1, help="k of pass@k and best@k (default 1)")
    p.add_argument("--n", type=int, default=None, help="samples per problem (default k); n >= k")
    p.add_argument("--sample", action="store_true", help="sample at --temperature instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature with --sample")
    p.add_argument("--max-new-tokens", type=int, default=512, help="response budget (paper: 8192)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many problems per benchmark (procedural default 200)")
    p.add_argument("--template", default="auto", help="prompt template: auto | chat | plain | a '{question}' string")
    p.add_argument("--difficulty", type=int, default=2, help="procedural task difficulty")
    p.add_argument("--task-seed", type=int, default=1234, help="procedural task seed (the training data's seed)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--verifier-workers", type=int, default=0, help="verifier processes (0: in-process)")
    p.add_argument("--verifier-mode", default="math", help="math (paper's exact match) | math_verify")
    p.add_argument("--verifier-timeout-s", type=float, default=5.0,
                   help="seconds one response may take to score (a --checker always runs under it)")
    p.add_argument("--checker", default=None, metavar="MODULE:FUNCTION",
                   help="a user's verifier instead of the built-in one: 'pkg.module:function' or "
                        "'file.py:function', f(response, reference) -> reward in --reward-range, or verl's "
                        "compute_score(data_source, solution_str, ground_truth, extra_info=None) (examples/custom_task)")
    p.add_argument("--reward-range", type=float, nargs=2, default=[0.0, 1.0], metavar=("LOW", "HIGH"),
                   help="the --checker's reward range, mapped onto [0, 1]; a sample counts as correct above LOW "
                        "(default 0 1)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--out", default=None, help="write results.json, results.md and samples.jsonl here")


def _per_agent(values: list[str] | None, agents: list[str], flag: str) -> list[str | None]:
    if not values:
        return [None] * len(agents)
    if len(values) == 1:
        return values * len(agents)
    if len(values) != len(agents):
        raise SystemExit(f"hacrl eval: {len(values)} {flag} values for {len(agents)} --agent values")
    return list(values)


def _check_inputs(args: argparse.Namespace, tokenizers: list[str | None]) -> EvalData:
    """Every argument, agent folder and output path, before any model loads (like ``hacrl convert``)."""
    check_eval_args(args)
    if args.out:
        claim_output(args.out, "--out")
    for agent, tok in zip(args.agent, tokenizers, strict=True):
        check_agent_folder(agent, own_tokenizer=tok is None)
    if any(tok in ("char", "pair", "smollm2") for tok in tokenizers) or "smollm2" in args.agent:
        check_dir(default_cache_dir(), f"the cache (${CACHE_ENV})")  # built-in tokenizers and SmolLM2 live there
    try:
        return EvalData(args.benchmarks, dict(args.data), limit=args.limit, difficulty=args.difficulty,
                        task_seed=args.task_seed)
    except ValueError as err:
        raise EvalInputError(str(err).replace("run_eval: ", "--benchmarks/--data: ")) from None


def main(args: argparse.Namespace) -> int:
    """Run ``hacrl eval``; prints the Table-1 style markdown table; returns 0."""
    from hacrl_megatron.console import log_to_console

    log_to_console()  # to whatever sys.stderr is at each message (a root handler would keep the first one)
    names = _per_agent(args.name, args.agent, "--name")
    if args.name and len(args.name) == 1 and len(args.agent) > 1:
        raise SystemExit("hacrl eval: give one --name per --agent")
    tokenizers = _per_agent(args.tokenizer, args.agent, "--tokenizer")
    data = _check_inputs(args, tokenizers)
    settings = EvalSettings(k=args.k, n=args.n, greedy=not args.sample, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, template=args.template, seed=args.seed)
    results = []
    score_fn = custom_score_fn(args.checker, field="--checker", reward_range=args.reward_range)  # before any model loads
    with VerifierPool(num_workers=args.verifier_workers, timeout_s=args.verifier_timeout_s, mode=args.verifier_mode,
                      score_fn=score_fn) as verifier:
        for agent, name, tok in zip(args.agent, names, tokenizers, strict=True):
            results.append(run_eval(agent, data, settings, tokenizer=tok, model_name=name, dtype=args.dtype,
                                    verifier=verifier))
    print(markdown_table(results), end="")
    if args.out:
        for kind, path in write_results(results, args.out).items():
            logger.info("wrote %s: %s", kind, path)
    return 0
