"""In-training evaluation: greedy accuracy of every agent's engine on the held-out set."""

from __future__ import annotations

from hacrl_megatron.config import ExperimentConfig
from hacrl_megatron.data import PromptRecord
from hacrl_megatron.eval.evaluate import EvalSettings, evaluate
from hacrl_megatron.reward.pool import VerifierPool
from hacrl_megatron.trainer.runtime import AgentRuntime


def evaluate_agents(runtimes: list[AgentRuntime], records: list[PromptRecord], verifier: VerifierPool,
                    max_new_tokens: int) -> dict[str, float]:
    """Greedy (temperature 0) accuracy of each agent on ``records``: {agent name: avg@1}."""
    out = {}
    for rt in runtimes:
        settings = EvalSettings(greedy=True, max_new_tokens=max_new_tokens, template=rt.cfg.prompt_template)
        result = evaluate(rt.engine, rt.tokenizer, {"eval": records}, settings, verifier=verifier,
                          model_name=rt.name)
        out[rt.name] = result.benchmarks["eval"].primary
    return out


def accuracy_table(history: dict[str, list[float]], exp: ExperimentConfig) -> str:
    """Markdown before/after table of greedy eval accuracy per agent."""
    lines = [f"| agent ({exp.hacpo.algorithm}) | before | after | change |", "|---|---|---|---|"]
    for name, values in history.items():
        before, after = values[0], values[-1]
        lines.append(f"| {name} | {before:.3f} | {after:.3f} | {after - before:+.3f} |")
    return "\n".join(lines)
