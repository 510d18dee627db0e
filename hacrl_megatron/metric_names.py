"""Every metric name a run logs (metrics.jsonl, TensorBoard, wandb): pattern, unit and meaning.

Patterns hold placeholders: ``<agent>`` (an agent's name, the learner k), ``<source>`` (another agent's
name, the source j of a response), ``<benchmark>`` (a name of ``data.eval_benchmarks``), ``<k>``
(``train.eval_samples``), ``<engine>`` (``engine0``, ``engine1``, ... of an agent's engine pool) and
``<stat>`` (a counter of the named component), ``<family>`` (a problem family of ``data.task``). The reference page ``docs/reference.md`` is generated
from this table, and a test trains tiny runs and checks that every name they log matches an entry.
Equations refer to docs/algorithm.md and the paper.
"""

from __future__ import annotations

import re

# (pattern, unit, meaning); "<agent>/hacpo/..." are means over the step's M mini-batch updates
METRICS: tuple[tuple[str, str, str], ...] = (
    ("step", "steps", "RL steps done (1 after the first step; 0: the evaluation before training)"),
    ("time", "s", "seconds since the metrics logger started"),
    ("<agent>/reward_mean", "reward", "mean verifier reward of the agent's own rollouts this step (in [0, 1])"),
    ("<agent>/reward/<family>/mean", "reward", "mean verifier reward of the agent's own rollouts on one problem "
     "family's prompts this step (a task with families; the per-family capability beside ω, eq. 10)"),
    ("<agent>/truncated_frac", "fraction", "share of the agent's responses cut at rollout.max_response_len"),
    ("<agent>/response_tokens_mean", "tokens", "mean response length in the agent's own tokens"),
    ("<agent>/old_logp_per_token", "nats/token", "mean log π_old per token of the agent's own responses"),
    ("<agent>/capability", "fraction", "P̂, the capability estimate: windowed mean positive rate (eq. 7-8)"),
    ("<agent>/omega/<source>", "ratio", "ω, the capability ratio the agent weights the source's responses by (eq. 9)"),
    ("<agent>/sequences", "sequences", "sequences in the agent's step batch (its own and every source's)"),
    ("<agent>/kl", "nats/token", "KL to the starting policy on the agent's own responses (hacpo.kl_coef > 0)"),
    ("<agent>/staleness", "steps", "weight versions the step's batch lags behind (rollout overlapping training)"),
    ("<agent>/sync_logp_diff", "nats", "|trainer − engine| log-prob of a probe response after the weight sync"),
    ("<agent>/rollout_tokens_per_s", "tokens/s", "the agent's engine generation speed"),
    ("<agent>/rollout_tokens_total", "tokens", "tokens the agent's engines generated so far"),
    ("<agent>/rollout/<engine>/<stat>", "per counter", "one engine's counters in an agent's engine pool"),
    ("<agent>/trainer/logprob_tokens_per_s", "tokens/s", "trainer speed of the log-prob (π_old) passes"),
    ("<agent>/trainer/train_tokens_per_s", "tokens/s", "trainer speed of the update passes"),
    ("<agent>/trainer/pad_fraction", "fraction", "share of the tokens the trainer ran that were padding (the last "
     "pass's micro-batches; train.max_tokens_per_microbatch and train.pack_sequences lower it)"),
    ("<agent>/trainer/peak_rss_mib", "MiB", "peak resident memory of the agent's trainer process"),
    ("<agent>/trainer/updates", "updates", "optimizer updates the agent made so far"),
    ("<agent>/trainer/offload_mib", "MiB", "rollout.colocate: the agent's state (per rank) in host memory at its "
     "last sleep while its engines generated (rollout.colocate_offload, docs/colocation.md)"),
    ("<agent>/trainer/offload_s", "s", "rollout.colocate: seconds the agent's trainer spent moving its state to host "
     "memory, whole run"),
    ("<agent>/trainer/wake_s", "s", "rollout.colocate: seconds the agent's trainer spent bringing its state back, "
     "whole run"),
    ("<agent>/trainer/<stat>", "per counter", "other counters a trainer reports (Ray ranks, GPU memory)"),
    ("<agent>/exchange/from_<source>/n", "sequences", "source responses re-tokenized for the agent this step"),
    ("<agent>/exchange/peers_missing", "agents", "hacrl train --agent: peers whose record did not come this step "
     "(exchange.on_missing=alone: the step trained on the agent's own responses)"),
    ("<agent>/exchange/wait_s", "s", "hacrl train --agent: the step's wait for its peers' records"),
    ("<agent>/exchange/from_<source>/token_ratio", "ratio", "learner tokens per source token of those responses"),
    ("<agent>/exchange/from_<source>/roundtrip_mismatch", "fraction",
     "share whose text changes through the learner's tokenizer (decode ∘ encode)"),
    ("<agent>/exchange/from_<source>/truncated_prompt", "fraction", "share whose prompt lost its left end"),
    ("<agent>/exchange/from_<source>/truncated_response", "fraction", "share whose response lost its right end"),
    ("<agent>/eval_accuracy", "fraction", "greedy accuracy on the task's held-out set (data.eval_size problems)"),
    ("<agent>/eval/<family>/accuracy", "fraction", "greedy accuracy on one problem family's share of the held-out "
     "set (a task with families, e.g. add_sub_cot: add, sub)"),
    ("<agent>/eval/<benchmark>/avg@<k>", "fraction",
     "mean share of correct samples per problem, k = train.eval_samples samples (data.eval_benchmarks)"),
    ("<agent>/eval/<benchmark>/pass@<k>", "fraction", "unbiased pass@k: at least one of k samples correct"),
    ("<agent>/hacpo/loss", "loss", "the agent's loss, summed over its sequences"),
    ("<agent>/hacpo/objective_mean", "advantage units", "mean clipped objective per sequence"),
    ("<agent>/hacpo/grad_norm", "norm", "gradient norm before clipping"),
    ("<agent>/hacpo/lr", "lr", "learning rate of the update"),
    ("<agent>/hacpo/update", "updates", "the agent's optimizer updates so far, at this update (mean over the step's)"),
    ("<agent>/hacpo/adv_abs_mean", "advantage units", "mean |A| over the update's sequences (eq. 6-7)"),
    ("<agent>/hacpo/num_self", "sequences", "the agent's own sequences in the update"),
    ("<agent>/hacpo/num_cross", "sequences", "other agents' sequences in the update"),
    ("<agent>/hacpo/self_ratio_mean", "ratio", "mean sequence ratio π_θ/π_old of own sequences"),
    ("<agent>/hacpo/self_ratio_min", "ratio", "smallest such ratio"),
    ("<agent>/hacpo/self_ratio_max", "ratio", "largest such ratio"),
    ("<agent>/hacpo/cross_ratio_mean", "ratio", "mean cross ratio s of other agents' sequences (eq. 11)"),
    ("<agent>/hacpo/cross_ratio_min", "ratio", "smallest cross ratio"),
    ("<agent>/hacpo/cross_ratio_max", "ratio", "largest cross ratio"),
    ("<agent>/hacpo/self_clipfrac", "fraction", "share of GSPO-clipped sequences left without gradient"),
    ("<agent>/hacpo/cross_clipfrac", "fraction",
     "share of cross sequences with A ≠ 0 the cross window leaves without gradient (eq. 14)"),
    ("<agent>/hacpo/cross_clipfrac/<source>/pos", "fraction", "the same among the source's sequences with A > 0"),
    ("<agent>/hacpo/cross_clipfrac/<source>/neg", "fraction", "the same among the source's sequences with A < 0"),
    ("<agent>/hacpo/cross_grad_share", "fraction", "‖g_cross‖/‖g‖, g = ∂ΣJ/∂ℓ per sequence (ℓ: its per-token "
     "mean log-likelihood): the share of the update carried by cross samples (docs/algorithm.md §10b)"),
    ("<agent>/hacpo/family/<family>/self_clipfrac", "fraction", "self_clipfrac among one problem family's sequences (a task with "
     "families; docs/algorithm.md §10b)"),
    ("<agent>/hacpo/family/<family>/cross_clipfrac/<source>/pos", "fraction", "cross_clipfrac/<source>/pos among the family's sequences"),
    ("<agent>/hacpo/family/<family>/cross_clipfrac/<source>/neg", "fraction", "cross_clipfrac/<source>/neg among the family's sequences"),
    ("<agent>/hacpo/family/<family>/cross_clipfrac/<source>/pos/above", "fraction", "the part of it whose ratio lies above the window"),
    ("<agent>/hacpo/family/<family>/cross_clipfrac/<source>/pos/below", "fraction", "the part of it whose ratio lies below the window (lb_m)"),
    ("<agent>/hacpo/family/<family>/cross_clipfrac/<source>/neg/above", "fraction", "the part of it whose ratio lies above the window"),
    ("<agent>/hacpo/family/<family>/cross_clipfrac/<source>/neg/below", "fraction", "the part of it whose ratio lies below the window (lb_m)"),
    ("<agent>/hacpo/family/<family>/cross_log_ratio_median/<source>", "log ratio", "median log s of the pair's sequences of the family"),
    ("<agent>/hacpo/family/<family>/cross_grad_share", "fraction", "cross_grad_share within the family's sequences: ‖g_cross,f‖/‖g_f‖"),
    ("<agent>/hacpo/cross_lower_bound", "ratio", "lower bound of the cross window at this update (eq. 14)"),
    ("<agent>/hacpo/cross_center/<source>", "log ratio", "the adaptive window's centre c for the pair (§5b)"),
    ("<agent>/hacpo/cross_log_ratio_median/<source>", "log ratio", "median log s of the pair's sequences"),
    ("<agent>/hacpo/cross_behaviour_weight_mean", "weight", "mean min(1, s at π_old) of cross sequences (§5d)"),
    ("<agent>/hacpo/onpolicy_ratio_dev", "ratio", "max |π_θ/π_old − 1| of own sequences at update 0 (float noise)"),
    ("<agent>/hacpo/behaviour_weight_mean", "weight", "mean truncated behaviour weight of stale own sequences (§7b)"),
    ("<agent>/hacpo/behaviour_truncfrac", "fraction", "share of stale own sequences whose weight is truncated"),
    ("<agent>/hacpo/kl", "nats/token", "KL to the starting policy (hacpo.kl_estimator)"),
    ("<agent>/hacpo/kl_penalty", "loss", "hacpo.kl_coef × KL, the penalty added to the loss"),
    ("<agent>/hacpo/token_clipfrac", "fraction", "GRPO: share of clipped tokens"),
    ("<agent>/hacpo/token_ratio_mean", "ratio", "GRPO: mean token ratio π_θ/π_old"),
    ("<agent>/hacpo/peer_weight_mean", "weight", "mutual_prp, ftis: mean density-ratio weight w of the other agents' "
     "sequences (docs/algorithm.md §8a)"),
    ("<agent>/hacpo/peer_truncfrac", "fraction", "mutual_prp, ftis: share of the other agents' sequences whose weight "
     "is truncated at its cap (§8a)"),
    ("<agent>/hacpo/peer_filtered_frac", "fraction", "ftis: share of the other agents' sequences filtered out "
     "(A < 0, per-token divergence above hacpo.ftis_kl_threshold; §8a)"),
    ("<agent>/hacpo/moe/aux_loss", "loss", "MoE load-balancing loss, token-weighted mean per layer"),
    ("<agent>/hacpo/moe/z_loss", "loss", "MoE router z-loss, token-weighted mean per layer"),
    ("<agent>/hacpo/moe/aux_loss_coeff", "coefficient", "model.moe_aux_loss_coeff"),
    ("<agent>/hacpo/moe/z_loss_coeff", "coefficient", "model.moe_z_loss_coeff"),
    ("time/rollout_s", "s", "rollout stage of the step"),
    ("time/exchange_s", "s", "hacrl train --agent: publishing this job's record, waiting for and reading the peers'"),
    ("time/verify_s", "s", "verifier stage"),
    ("time/old_logprob_s", "s", "π_old (and reference) log-prob passes"),
    ("time/samples_s", "s", "writing samples/step-NNNNNN.jsonl (its steps only: log.samples_every)"),
    ("time/train_s", "s", "advantages and the M updates of every agent"),
    ("time/sync_s", "s", "weight sync into the engines and its check"),
    ("time/checkpoint_wait_s", "s", "the loop's wait in the checkpoint saved after the previous step: copying "
     "every agent's state to host memory and finishing an earlier save (checkpoint.async_save), else the whole write"),
    ("verifier/timeouts", "responses", "responses whose scoring hit train.verifier_timeout_s, so far"),
    ("verifier/errors", "responses", "responses whose scoring failed or left data.reward_range, so far"),
    ("rollout/dropped_batches", "batches", "async batches dropped as too stale, so far"),
    ("rollout/wait_s", "s", "time the step waited for its batch (overlapping rollout modes)"),
)

_PLACEHOLDERS = {"<benchmark>": r"[^/]+", "<family>": r"[a-z]+", "<k>": r"\d+", "<engine>": r"engine\d+", "<stat>": r"[A-Za-z0-9_]+"}


def _regex(pattern: str, agents: list[str]) -> re.Pattern[str]:
    names = "|".join(re.escape(a) for a in sorted(agents, key=len, reverse=True)) or r"[^/]+"
    out = re.escape(pattern)
    for key, value in {**_PLACEHOLDERS, "<agent>": f"(?:{names})", "<source>": f"(?:{names})"}.items():
        out = out.replace(re.escape(key), value)
    return re.compile(out)


def describe(key: str, agents: list[str]) -> tuple[str, str, str] | None:
    """The :data:`METRICS` entry ``key`` (a logged name, agents named ``agents``) matches; None if none."""
    for entry in METRICS:
        if _regex(entry[0], agents).fullmatch(key):
            return entry
    return None
