"""In-training evaluation of every agent's engine: greedy accuracy on the task's held-out set
(``data.eval_size``), and avg@k / pass@k on the benchmarks of ``data.eval_benchmarks`` (the metrics of
``hacrl eval``: k = ``train.eval_samples`` samples per problem at ``train.eval_temperature``)."""

from __future__ import annotations

from collections.abc import Callable

from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.data import PromptRecord
from hacrl_megatron.eval.evaluate import EvalResult, EvalSettings, evaluate
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer.runtime import AgentRuntime


def evaluate_agents(runtimes: list[AgentRuntime], records: list[PromptRecord], verifier: VerifierPool,
                    max_new_tokens: int) -> dict[str, float]:
    """Greedy (temperature 0) accuracy of each agent on ``records``: {agent name: avg@1}."""
    out = {}
    for rt in runtimes:
        settings = EvalSettings(greedy=True, max_new_tokens=max_new_tokens, template=rt.cfg.prompt_template)
        result = evaluate(rt.engine, rt.tokenizer, {"eval": records}, settings, verifier=verifier,
                          model_name=rt.name, log_each=False)
        out[rt.name] = result.benchmarks["eval"].primary
    return out


def family_accuracy_key(agent: str, family: str) -> str:
    """The metric name of one agent's greedy accuracy on one problem family: ``<agent>/eval/<family>/accuracy``."""
    return f"{agent}/eval/{family}/accuracy"


def evaluate_agents_by_family(runtimes: list[AgentRuntime], records: list[PromptRecord], family_of: Callable[[PromptRecord], str | None],
                              verifier: VerifierPool, max_new_tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """Greedy accuracy of each agent on ``records`` and on each family's share of them (a task with problem
    families, e.g. ``add_sub_cot``): ({agent: accuracy on all}, {:func:`family_accuracy_key`: accuracy}).

    Each family's records are generated as a group (no record twice); the overall accuracy is the count of
    correct answers over all records, so it is the records' plain mean, as :func:`evaluate_agents` gives."""
    groups: dict[str, list[PromptRecord]] = {}
    for rec in records:
        groups.setdefault(family_of(rec) or "other", []).append(rec)
    overall, per_family = {}, {}
    for rt in runtimes:
        correct = 0
        for family, group in groups.items():
            accuracy = evaluate_agents([rt], group, verifier, max_new_tokens)[rt.name]
            per_family[family_accuracy_key(rt.name, family)] = accuracy
            correct += round(accuracy * len(group))
        overall[rt.name] = correct / len(records) if records else 0.0
    return overall, per_family


def benchmark_settings(exp: ExperimentConfig, template: str, step: int) -> EvalSettings:
    """How a benchmark evaluation samples: k = n = ``train.eval_samples`` at ``train.eval_temperature``
    (0: greedy), responses of at most ``rollout.max_response_len`` tokens, seeded per step."""
    t = exp.train
    return EvalSettings(k=t.eval_samples, greedy=t.eval_temperature == 0, temperature=t.eval_temperature or 1.0,
                        top_p=exp.rollout.top_p, max_new_tokens=exp.rollout.max_response_len, template=template,
                        primary={}, seed=t.seed * 1_000_003 + step)


def benchmark_keys(agent: str, bench: str, k: int) -> tuple[str, str]:
    """The metric names of one agent on one benchmark: ``<agent>/eval/<bench>/avg@k`` and ``.../pass@k``."""
    return f"{agent}/eval/{bench}/avg@{k}", f"{agent}/eval/{bench}/pass@{k}"


def evaluate_benchmarks(runtimes: list[AgentRuntime], benchmarks: dict[str, list[PromptRecord]],
                        verifier: VerifierPool, exp: ExperimentConfig, step: int) -> dict[str, float]:
    """avg@k and pass@k (fractions in [0, 1]) of each agent on each benchmark, named by :func:`benchmark_keys`.

    Each agent is evaluated alone with its own prompt template, as ``hacrl eval`` would evaluate its
    exported weights (at inference the agents do not collaborate)."""
    out: dict[str, float] = {}
    for rt in runtimes:
        result: EvalResult = evaluate(rt.engine, rt.tokenizer, benchmarks,
                                      benchmark_settings(exp, rt.cfg.prompt_template, step), verifier=verifier,
                                      model_name=rt.name, log_each=False)
        for bench, b in result.benchmarks.items():
            avg_key, pass_key = benchmark_keys(rt.name, bench, b.k)
            out[avg_key], out[pass_key] = b.avg, b.pass_at_k
    return out


def format_scores(scores: dict[str, float]) -> str:
    """One line of :func:`evaluate_benchmarks`' scores: ``llama: addition avg@4=0.290 pass@4=0.620; qwen3: ...``."""
    per_agent: dict[str, dict[str, list[str]]] = {}
    for key, value in scores.items():
        agent, _, rest = key.partition("/eval/")
        bench, _, metric = rest.partition("/")
        per_agent.setdefault(agent, {}).setdefault(bench, []).append(f"{metric}={value:.3f}")
    return "; ".join(f"{agent}: " + ", ".join(f"{bench} {' '.join(parts)}" for bench, parts in benches.items())
                     for agent, benches in per_agent.items())


def accuracy_table(history: dict[str, list[float]], exp: ExperimentConfig) -> str:
    """Markdown before/after table: each agent's greedy accuracy on the held-out set (rows named by the
    agent), then each agent's avg@k on each benchmark (rows ``<agent>: <benchmark> avg@k``)."""
    lines = [f"| agent ({exp.hacpo.algorithm}) | before | after | change |", "|---|---|---|---|"]
    for name, values in history.items():
        agent, _, rest = name.partition("/eval/")
        label = f"{agent}: {rest.replace('/', ' ')}" if rest else name
        before, after = values[0], values[-1]
        lines.append(f"| {label} | {before:.3f} | {after:.3f} | {after - before:+.3f} |")
    return "\n".join(lines)
