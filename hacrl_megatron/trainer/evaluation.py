"""In-training evaluation: greedy accuracy of every agent's engine on the held-out set."""

from __future__ import annotations

from hacrl_megatron.config import ExperimentConfig


def evaluate_agents(runtimes, records, verifier, max_new_tokens: int) -> dict[str, float]:
    """Greedy (temperature 0) accuracy of each agent on ``records``: {agent name: mean reward}."""
    from hacrl_megatron.reward.verify import RewardRequest
    from hacrl_megatron.rollout.types import SamplingParams

    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    out = {}
    for rt in runtimes:
        completions = rt.engine.generate([rt.prompt_ids(r.question) for r in records], params)
        scores = verifier.score([RewardRequest(r.kind, c[0].text, r.answer) for r, c in zip(records, completions)])
        out[rt.name] = sum(scores) / max(len(scores), 1)
    return out


def accuracy_table(history: dict[str, list[float]], exp: ExperimentConfig) -> str:
    """Markdown before/after table of greedy eval accuracy per agent."""
    lines = [f"| agent ({exp.hacpo.algorithm}) | before | after | change |", "|---|---|---|---|"]
    for name, values in history.items():
        before, after = values[0], values[-1]
        lines.append(f"| {name} | {before:.3f} | {after:.3f} | {after - before:+.3f} |")
    return "\n".join(lines)
