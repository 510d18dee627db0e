"""In-training evaluation: greedy accuracy of every agent's engine on the held-out set."""

from __future__ import annotations

from hacrl_megatron.config import ExperimentConfig


def evaluate_agents(runtimes, records, verifier, max_new_tokens: int) -> dict[str, float]:
    """Greedy (temperature 0) accuracy of each agent on ``records``: {agent name: avg@1}."""
    from hacrl_megatron.eval.evaluate import evaluate

    out = {}
    for rt in runtimes:
        result = evaluate(rt.engine, rt.tokenizer, {"eval": records}, greedy=True, max_new_tokens=max_new_tokens,
                          verifier=verifier, template=rt.cfg.prompt_template, model_name=rt.name)
        out[rt.name] = result.benchmarks["eval"].primary
    return out


def accuracy_table(history: dict[str, list[float]], exp: ExperimentConfig) -> str:
    """Markdown before/after table of greedy eval accuracy per agent."""
    lines = [f"| agent ({exp.hacpo.algorithm}) | before | after | change |", "|---|---|---|---|"]
    for name, values in history.items():
        before, after = values[0], values[-1]
        lines.append(f"| {name} | {before:.3f} | {after:.3f} | {after - before:+.3f} |")
    return "\n".join(lines)
