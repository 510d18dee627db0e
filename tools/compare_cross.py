"""The cross-sample sections of tools/compare.py's report: the cross window's per-pair statistics of HACPO
runs (clip fractions by the sign of A, the adaptive centre, median log s, ω, the cross samples' share of the
update) and the peer rows of the ways to share rollouts of docs/algorithm.md §8a, each a mean over a run's
steps, then over seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hacrl_megatron.config.schema import SHARING_ALGORITHMS, TOKEN_LEVEL_ALGORITHMS
from tools.compare_report import _fmt, _mean_or_none, label


def _per_seed_values(runs_metrics: list[list[dict[str, Any]]], key: str) -> list[list[float]]:
    """``key``'s logged values, step by step, in each run (one list per seed; empty where never logged)."""
    return [[row[key] for row in rows if key in row] for rows in runs_metrics]


def step_then_seed_mean(runs_metrics: list[list[dict[str, Any]]], key: str) -> float | None:
    """The mean over each run's steps of ``key``, then over the runs that log it; None when none does."""
    return _mean_or_none([sum(vs) / len(vs) for vs in _per_seed_values(runs_metrics, key) if vs])


@dataclass(frozen=True)
class PairStats:
    """Cross samples of one (learner, source) pair in one method, averaged over steps, then over seeds.

    clipfrac_pos / clipfrac_neg: share of the pair's cross samples with A > 0 / A < 0 that get no
    gradient; center_mean / center_last: the adaptive window's shift in log space (docs/algorithm.md
    §5b; 0 for the fixed window); log_ratio_median: the step median of log s (eq. 11); grad_share: the
    learner's ``cross_grad_share`` (``hacpo.log_cross_grad_share``; None when not logged); omega: the logged
    capability ratio ω^(k,j) = P̂^(k)/P̂^(j) of learner k and source j (eq. 9, ``<learner>/omega/<source>``),
    which re-weights the source's rewards in the learner's baseline; its inverse pair ω^(j,k) is the cross
    term's discrepancy coefficient (eq. 10, dropped by −ω); None when not logged."""

    method: str
    learner: str
    source: str
    clipfrac_pos: float | None
    clipfrac_neg: float | None
    center_mean: float | None
    center_last: float | None
    log_ratio_median: float | None
    grad_share: float | None = None
    omega: float | None = None


def pair_stats(method: str, runs_metrics: list[list[dict[str, Any]]], agent_names: list[str]) -> list[PairStats]:
    """Per-pair cross statistics of one method from the ``metrics.jsonl`` rows of its runs (one list per
    seed); a pair whose keys never appear (GSPO, Naive, or a run without cross samples) gets None values."""
    stats = []
    for learner in agent_names:
        for source in agent_names:
            if source == learner:
                continue
            prefix = f"{learner}/hacpo/"
            keys = {"pos": f"{prefix}cross_clipfrac/{source}/pos", "neg": f"{prefix}cross_clipfrac/{source}/neg",
                    "center": f"{prefix}cross_center/{source}", "median": f"{prefix}cross_log_ratio_median/{source}",
                    "share": f"{prefix}cross_grad_share", "omega": f"{learner}/omega/{source}"}
            mean = {name: step_then_seed_mean(runs_metrics, key) for name, key in keys.items()}
            last = _mean_or_none([vs[-1] for vs in _per_seed_values(runs_metrics, keys["center"]) if vs])
            stats.append(PairStats(method, learner, source, mean["pos"], mean["neg"], mean["center"], last,
                                   mean["median"], mean["share"], mean["omega"]))
    return stats


def pair_table(stats: list[PairStats]) -> str:
    """Markdown: one row per (method, learner ← source) that has cross statistics; '' if none has."""
    rows = [s for s in stats if s.clipfrac_pos is not None or s.log_ratio_median is not None]
    if not rows:
        return ""
    share = any(s.grad_share is not None for s in rows)  # a column only when logged (hacpo.log_cross_grad_share)
    omega = any(s.omega is not None for s in rows)
    lines = ["| method | learner ← source | clipped A > 0 | clipped A < 0 | centre c (mean, last step) | "
             "median log s |" + (" ω (mean) |" if omega else "") + (" cross_grad_share |" if share else ""),
             "|---|---|---|---|---|---|" + ("---|" * omega) + ("---|" * share)]
    for s in rows:
        lines.append(f"| {label(s.method)} | {s.learner} ← {s.source} | {_fmt(s.clipfrac_pos, '.2f')} | "
                     f"{_fmt(s.clipfrac_neg, '.2f')} | {_fmt(s.center_mean, '+.2f')}, {_fmt(s.center_last, '+.2f')} | "
                     f"{_fmt(s.log_ratio_median, '+.2f')} |" + (f" {_fmt(s.omega, '.2f')} |" if omega else "")
                     + (f" {_fmt(s.grad_share, '.2f')} |" if share else ""))
    return "\n".join(lines) + "\n"


PEER_KEYS = ("num_cross", "peer_weight_mean", "peer_truncfrac", "peer_filtered_frac", "cross_clipfrac")


def peer_table(method: str, runs_metrics: list[list[dict[str, Any]]], agent_names: list[str]) -> str:
    """Markdown rows (no header) of one peer-sharing method (docs/algorithm.md §8a): per learner, the means
    over steps, then seeds, of ``<learner>/hacpo/<key>`` for :data:`PEER_KEYS` (peer rows in one update of
    the learner, their mean weight w, the shares truncated and filtered, the share whose clip of ρ leaves
    no gradient); a key a method never logs shows n/a; '' when the method logs none of them."""
    lines = []
    for learner in agent_names:
        per_key = [step_then_seed_mean(runs_metrics, f"{learner}/hacpo/{key}") for key in PEER_KEYS]
        if any(v is not None for v in per_key):
            lines.append(f"| {label(method)} | {learner} | " + " | ".join(_fmt(v, ".2f") for v in per_key) + " |")
    return "\n".join(lines)


def cross_sections(runs: dict[str, list[tuple[str, list[dict[str, Any]]]]], agent_names: list[str]) -> str:
    """compare.md's sections on cross samples: ``runs`` maps each method to its runs' (``hacpo.algorithm``,
    ``metrics.jsonl`` rows). The per-pair window statistics of the HACPO runs (:func:`pair_stats`; the cross
    window exists only in HACPO and its variants, Naive clips cross samples with the self clip), then the
    peer rows of the ways to share rollouts of docs/algorithm.md §8a (:func:`peer_table`: the sharing
    methods with GRPO's token-level loss); '' when neither has rows."""
    text = ""
    pairs = pair_table([s for m, rs in runs.items() for s in pair_stats(m, [r for a, r in rs if a == "hacpo"],
                                                                        agent_names)])
    if pairs:
        text += "\n### Cross samples per (learner ← source) pair, mean over steps then seeds\n\n" + pairs
    peer_sharing = set(SHARING_ALGORITHMS) & set(TOKEN_LEVEL_ALGORITHMS)
    peers = [t for m, rs in runs.items() if (t := peer_table(m, [r for a, r in rs if a in peer_sharing], agent_names))]
    if peers:
        text += ("\n### Peer responses in the peer-sharing methods, mean over steps then seeds\n\n"
                 "| method | learner | peer rows per update | mean weight w | truncated | filtered | clipped (no gradient) |\n"
                 "|---|---|---|---|---|---|---|\n" + "\n".join(peers) + "\n")
    return text
