"""The planner's output: one JSON object (``--json``) or a text table, with every assumption stated."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hacrl_megatron.plan.memory import (
    ENGINE_RESIDUAL_GIB,
    ENGINE_RUNTIME_GIB,
    FUSED_WORKSPACE_BYTES,
    GIB,
    OVERHEAD_GIB,
    Layout,
)
from hacrl_megatron.plan.params import rank_params
from hacrl_megatron.plan.search import AgentPlan, Cluster
from hacrl_megatron.plan.timing import (
    MEASURED_SYNC_S_PER_GB,
    MEASURED_SYNC_SOURCE,
    SCHEDULE,
    STAGES,
    Assumptions,
    sync_bandwidth_gb_s,
    sync_bandwidth_source,
)

if TYPE_CHECKING:
    from hacrl_megatron.plan.experiment import ExperimentPlan

ACCOUNTING = (
    "model state per parameter (Megatron mixed precision + Adam): bf16 weights 2 B, fp32 main grads 4 B "
    "(bf16 grads 2 B when grad_dtype=bfloat16), fp32 master weights + Adam moments 12 B: 18 B/param, "
    "6 + 12/DP with the distributed optimizer",
    "activations: Korthikanti et al. 2022 (arXiv 2205.05198) Table 2 method, counted for the model's real "
    "shapes (SwiGLU, grouped-query attention, no dropout; 16-bit activations); fused attention (Transformer "
    "Engine) keeps no score matrix, so 'none' and 'selective' differ only by a fp32 log-sum-exp",
    "1F1B pipeline: stage i of p keeps min(p - i, micro-batches per DP rank) micro-batches in flight; full "
    "recompute adds one re-materialised layer of one micro-batch",
    "log-prob head on the last stage, on the trainer's path (logprob_impl; agents/logprob_path.py): our fused "
    "kernel (auto, reference, triton; also under sequence parallelism) keeps the scored rows' bf16 hidden states "
    f"(2 B x tokens x h, all-gathered over TP under sequence parallelism), 8 B per token and one "
    f"{FUSED_WORKSPACE_BYTES / 2**20:.0f} MiB backward slice; megatron's materialised logits keep bf16 logits + "
    "fp32 softmax, 6 B x tokens x V_pad/tp, and the output layer's input (2 B x tokens x h, /tp under sequence "
    "parallelism)",
    f"fixed reserve per trainer GPU: {OVERHEAD_GIB:g} GiB (CUDA context, NCCL buffers, allocator fragmentation)",
    f"rollout engine: keeps mem_fraction x GPU memory (SGLang --mem-fraction-static): bf16 weights / engine TP, "
    f"{ENGINE_RUNTIME_GIB:g} GiB runtime, the rest KV cache (2 x layers x KV heads per GPU x head_dim x 2 B per "
    "token; KV heads replicated when engine TP exceeds them)",
    "colocation: separate (engines on their own GPUs) | release (ours: the engine frees its memory while the "
    f"trainer steps, {ENGINE_RESIDUAL_GIB:g} GiB residue; the trainer's weights, grads and optimizer stay "
    "while it generates) | offload (NeMo-RL/verl: trainer grads and optimizer in host memory while generating) | "
    "resident (the engine never frees its share); the peak is the larger of the two phases",
    "memory_gib describes the most loaded pipeline stage at its peak phase; 1 GiB = 2^30 bytes (an '80 GB' "
    "H100 has 74.5 GiB)",
)
VOCAB_RULE = ("vocabulary padded to a multiple of tp (the provider's make_vocab_size_divisible_by = 1 rule); "
              "padded rows are held by the embedding and the output layer")


OVERLAP_RULE = ("train.rollout_mode one_step_off: the rollout of step t+1 runs while step t verifies, computes "
                "pi_old, trains and syncs, so a steady-state step is max(rollout, verify + pi_old + train + sync); "
                "async with any max_staleness K >= 1 has the same bound (rollout produces one step's batch per "
                "rollout time, training consumes one per rest-of-step time); colocated engines cannot overlap "
                "(they hand their GPUs to the trainer), so the overlapped figure comes from a plan with engines "
                "on GPUs of their own")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def step_fields(plan: ExperimentPlan) -> dict[str, Any]:
    """The step-time keys of ``hacrl plan --json`` (seconds): ``step_time_s`` (the loop's schedule,
    synchronous rollout), ``step_time_sequential_s`` (the previous loop: agents one after another
    outside training), ``step_time_one_step_off_s`` / ``step_time_async_s`` (rollout overlapped;
    None when this plan's engines are colocated), ``step_stages_s`` (each stage's slowest agent),
    ``step_separate_jobs_s`` (each agent as its own job: ``own_s``, ``barrier_wait_s``, ``step_s``),
    and the run's terms outside a step: ``checkpoint_s`` (one checkpoint's write), ``checkpoint_wait_s``
    (what one save holds the loop: the copy to host memory, ``checkpoint_snapshot_s``, plus the whole
    write when synchronous or the part the steps until the next save do not cover with
    ``checkpoint_async``), ``checkpoint_host_gib`` (host memory per node for the copies),
    ``checkpoints`` (how many), ``export_s`` (the final export), ``run_time_s`` (every step, every
    save's wait, the last asynchronous write and the export)."""
    s = plan.step
    return {"step_time_s": _r(s["total_s"]), "step_time_sequential_s": _r(s["sequential_s"]),
            "checkpoint_s": _r(s["checkpoint_s"]), "checkpoint_wait_s": _r(s["checkpoint_wait_s"]),
            "checkpoint_async": s["checkpoint_async"], "checkpoint_snapshot_s": _r(s["checkpoint_snapshot_s"]),
            "checkpoint_host_gib": _r(s["checkpoint_host_gib"]),
            "checkpoints": s["checkpoints"], "export_s": _r(s["export_s"]),
            "run_time_s": _r(s["run_s"]),
            "step_time_one_step_off_s": _r(s["one_step_off_s"]), "step_time_async_s": _r(s["async_s"]),
            "step_stages_s": {k: _r(s[k]) for k in STAGES},
            "step_gspo_x2_s": {"rollout_s": _r(s["gspo_x2_rollout_s"]), "total_s": _r(s["gspo_x2_total_s"]),
                               "hacpo_rollout_saving_s": _r(s["hacpo_rollout_saving_s"])},
            "step_schedule": SCHEDULE, "step_overlap_rule": OVERLAP_RULE, "step_objective": plan.objective,
            "step_separate_jobs_s": {name: {k: _r(v) for k, v in job.items()}
                                     for name, job in s.get("separate_jobs", {}).items()}}


def placement_dict(plan: ExperimentPlan) -> dict[str, Any]:
    """Where every agent's trainer ranks and engines go: (node, first local GPU, GPUs) spans."""
    pl = plan.placement
    return {"colocated": pl.colocated, "agents": [
        {"name": p.name, "trainer": [{"node": n, "first_gpu": f, "gpus": c} for n, f, c in spans],
         "engines": [{"node": e.node, "first_gpu": e.first, "gpus": e.gpus} for e in engines]}
        for p, spans, engines in zip(plan.agents, pl.trainers, pl.engines)]}


def _gib(x: float) -> float:
    return round(x / GIB, 2)


def layout_dict(layout: Layout) -> dict[str, Any]:
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "sequence_parallel": layout.sequence_parallel,
            "recompute": layout.recompute, "distributed_optimizer": layout.distributed_optimizer,
            "ep": layout.ep, "etp": layout.etp, "cp": layout.cp}


def agent_dict(p: AgentPlan, source: str | None = None) -> dict[str, Any]:
    """The JSON record of one agent (keys of the ``hacrl plan --json`` contract first)."""
    terms = {k: _gib(v) for k, v in p.peak.terms.items()}
    memory = {k: terms[k] for k in ("weights", "grads", "optimizer", "activations", "engine")}
    memory["overhead"] = terms["overhead"]
    memory["total"] = _gib(p.peak.total)
    rp = rank_params(p.spec, p.layout.tp, p.layout.pp, ep=p.layout.ep, etp=p.layout.etp)
    last = p.stages[-1]
    out: dict[str, Any] = {
        "name": p.name,
        "layout": layout_dict(p.layout),
        "params_per_stage": list(rp.per_stage),
        "memory_gib": memory,
        "fits": p.fits,
        "reasons": list(p.reasons),
        "peak": {"stage": p.peak.stage.stage, "phase": p.peak.phase, "colocation": p.peak.colocation},
        "stages_gib": [{"stage": s.stage, "params": s.params, "activations": _gib(s.activations),
                        "total": _gib(s.total)} for s in p.stages],
        "params": {"hf_total": rp.hf_total, "all_ranks": rp.all_ranks, "tp_replicated_extra": rp.tp_replicated_extra,
                   "vocab_padding_extra": rp.vocab_padding_extra, "tied_copy_extra": rp.tied_copy_extra,
                   "padded_vocab": p.spec.padded_vocab_size(p.layout.tp)},
        "logits_gib": _logits(p, last),
        "gpus": {"partition": p.gpus, "trainer": p.trainer_gpus, "engines": p.engine_gpus},
        "time_s": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.times.items()},
    }
    if p.rollout is not None and p.engine is not None:
        e = p.engine
        out["rollout"] = {"colocation": p.rollout.colocation, "engine_tp": p.rollout.engine_tp, "engines": p.engines,
                          "mem_fraction": p.rollout.fraction, "transport": p.rollout.transport,
                          "share_gib": _gib(e.share), "weights_gib": _gib(e.weights), "kv_cache_gib": _gib(e.kv_cache),
                          "kv_tokens": e.kv_tokens, "kv_bytes_per_token_per_gpu": e.kv_bytes_per_token}
    if source:
        out["source"] = source
    return out


def _logits(p: AgentPlan, last: Any) -> dict[str, Any]:
    """The last stage's log-prob path, its activations on that path and on the other one, and the
    materialised logits counted in them (0 on the fused path)."""
    fused = last.activations - (last.logits_avoided if last.logprob_path == "megatron" else 0.0)
    return {"path": last.logprob_path, "logits": _gib(last.logits),
            "last_stage_activations": _gib(last.activations),
            "last_stage_activations_with_fused_kernel": _gib(fused),
            "last_stage_activations_with_materialised_logits": _gib(fused + last.logits_avoided),
            "saved_by_fused_kernel": _gib(last.logits_avoided)}


SYNC_TRANSPORTS = ("tensor", "distributed", "disk")


def assumptions_dict(a: Assumptions, cluster: Cluster) -> dict[str, Any]:
    """The plan's constants; ``sync``: the bandwidth each weight-sync transport is assumed to reach
    (``bandwidth_gb_s``, what ``time_s.sync_transfer_s`` divides by), where that comes from, and
    what the package measured of its own push (seconds per GB on gloo over loopback, CPU)."""
    g = cluster.gpu
    sync = {"bandwidth_gb_s": {t: sync_bandwidth_gb_s(t, g, a) for t in SYNC_TRANSPORTS},
            "bandwidth_source": {t: sync_bandwidth_source(t, g, a) for t in SYNC_TRANSPORTS},
            "measured_s_per_gb": dict(MEASURED_SYNC_S_PER_GB), "measured_source": MEASURED_SYNC_SOURCE}
    return {"time": a.as_dict(), "gpu": {"name": g.name, "bf16_tflops": g.bf16_tflops, "hbm_gbps": g.hbm_gbps,
                                        "nvlink_gbps": g.nvlink_gbps, "network_gbps_per_gpu": g.network_gbps},
            "memory": list(ACCOUNTING), "vocab_padding": VOCAB_RULE, "sync": sync}


def text_table(agents: list[dict[str, Any]]) -> str:
    """A fixed-width table: one row per agent."""
    head = (f"{'agent':24s} {'tp':>3s} {'pp':>3s} {'dp':>3s} {'sp':>3s} {'recompute':>9s} {'w':>6s} {'g':>6s} "
            f"{'opt':>6s} {'act':>6s} {'eng':>6s} {'total':>7s}  fits")
    rows = [head, "-" * len(head)]
    for a in agents:
        lay, m = a["layout"], a["memory_gib"]
        rows.append(f"{a['name'][:24]:24s} {lay['tp']:3d} {lay['pp']:3d} {lay['dp']:3d} "
                    f"{'y' if lay['sequence_parallel'] else 'n':>3s} {lay['recompute']:>9s} {m['weights']:6.1f} "
                    f"{m['grads']:6.1f} {m['optimizer']:6.1f} {m['activations']:6.1f} {m['engine']:6.1f} "
                    f"{m['total']:7.1f}  {'yes' if a['fits'] else 'NO'}")
    return "\n".join(rows)


def render_text(obj: dict[str, Any]) -> str:
    """Human-readable plan: table, per-agent details, step time, assumptions, overrides / YAML."""
    lines = ["memory per GPU in GiB (most loaded pipeline stage, peak phase)", text_table(obj["agents"]), ""]
    for a in obj["agents"]:
        lines.append(f"{a['name']}: params per stage (one TP rank) {a['params_per_stage']}; HF total "
                     f"{a['params']['hf_total']:,}; padded vocab {a['params']['padded_vocab']}")
        lay = a["layout"]
        if lay["ep"] * lay["etp"] > 1:  # MoE: how the experts are laid out
            edp = lay["tp"] * lay["cp"] * lay["dp"] // (lay["ep"] * lay["etp"])
            lines.append(f"  experts: ep={lay['ep']} etp={lay['etp']}, expert-data-parallel {edp} (the experts' "
                         "optimizer state is sharded over it)")
        lg = a["logits_gib"]
        if lg["path"] == "megatron":
            lines.append(f"  materialised logits (logprob_impl megatron) hold {lg['logits']:.2f} GiB on the last "
                         f"stage; the fused kernel would save {lg['saved_by_fused_kernel']:.2f} GiB "
                         f"({lg['last_stage_activations']:.2f} -> "
                         f"{lg['last_stage_activations_with_fused_kernel']:.2f} GiB of activations)")
        else:
            lines.append(f"  fused log-prob kernel saves {lg['saved_by_fused_kernel']:.2f} GiB on the last stage "
                         f"({lg['last_stage_activations_with_materialised_logits']:.2f} -> "
                         f"{lg['last_stage_activations_with_fused_kernel']:.2f} GiB of activations)")
        if "rollout" in a:
            r = a["rollout"]
            sync = obj["assumptions"]["sync"]
            lines.append(f"  rollout: {r['engines']} x TP{r['engine_tp']} engine(s), {r['colocation']}, "
                         f"{r['mem_fraction']:g} of each GPU: weights {r['weights_gib']:.1f} GiB, KV cache "
                         f"{r['kv_cache_gib']:.1f} GiB = {r['kv_tokens']:,} tokens; sync by {r['transport']} at "
                         f"{sync['bandwidth_gb_s'][r['transport']]:g} GB/s ({sync['bandwidth_source'][r['transport']]})")
        t = a["time_s"]
        if t:
            lines.append("  time (s): " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in t.items()))
        lines += [f"  NOT FITTING: {r}" for r in a["reasons"]]
    if obj.get("step_time_s"):
        lines += [""] + _step_lines(obj)
    lines += ["", "assumptions:"] + [f"  - {x}" for x in obj["assumptions"]["memory"]]
    lines.append(f"  - {obj['assumptions']['vocab_padding']}")
    lines.append("  - time: " + ", ".join(f"{k}={v}" for k, v in obj["assumptions"]["time"].items()))
    g = obj["assumptions"]["gpu"]
    lines.append(f"  - GPU {g['name']}: {g['bf16_tflops']:g} TFLOP/s bf16 dense, {g['hbm_gbps']:g} GB/s HBM, "
                 f"NVLink {g['nvlink_gbps']:g} GB/s, network {g['network_gbps_per_gpu']:g} GB/s per GPU")
    sync = obj["assumptions"]["sync"]
    measured = sync["measured_s_per_gb"]
    lines.append("  - weight sync bandwidth (assumed, not measured on GPUs): " + ", ".join(
        f"{t} {sync['bandwidth_gb_s'][t]:g} GB/s" for t in SYNC_TRANSPORTS) + "; measured of the package's own push: "
        f"{measured['stages_gloo_cpu']:g} s/GB from every pipeline stage, {measured['rank0_funnel_gloo_cpu']:g} s/GB "
        f"through rank 0 ({sync['measured_source']})")
    for note in obj.get("notes", []):
        lines.append(f"  - note: {note}")
    if obj.get("overrides"):
        lines += ["", "overrides (hacrl train / hacrl launch accept them as they are):", "  " + " ".join(obj["overrides"])]
    return "\n".join(lines)


def _step_lines(obj: dict[str, Any]) -> list[str]:
    st, g = obj["step_stages_s"], obj["step_gspo_x2_s"]
    lines = [f"step estimate: {obj['step_time_s']:.1f} s = rollout {st['rollout_s']:.1f} + verify {st['verify_s']:.1f}"
             f" + re-tokenise {st['retokenize_s']:.1f} + pi_old {st['old_logprob_s']:.1f} + train {st['train_s']:.1f}"
             f" + sync {st['sync_s']:.1f} (every stage for all agents at once, each its slowest agent's time)",
             f"  run: {obj['run_time_s']:.0f} s = steps + {obj['checkpoints']} checkpoint wait(s) of "
             f"{obj['checkpoint_wait_s']:.1f} s" + (f" + the last checkpoint's write {obj['checkpoint_s']:.1f} s"
                                                    if obj["checkpoint_async"] and obj["checkpoints"] else "")
             + f" + final export {obj['export_s']:.1f} s (evaluation not counted)",
             f"  checkpoint: {obj['checkpoint_s']:.1f} s to write (every agent at once, hashed as written); each save "
             f"holds the loop {obj['checkpoint_wait_s']:.1f} s = "
             f"{100 * obj['checkpoint_wait_s'] / max(obj['step_time_s'], 1e-9):.1f}% of a step ("
             + (f"checkpoint.async_save: {obj['checkpoint_snapshot_s']:.1f} s copying each GPU's share to host memory, "
                f"up to {obj['checkpoint_host_gib']:.0f} GiB per node, and the part of the previous write the steps "
                "since did not cover" if obj["checkpoint_async"]
                else "checkpoint.async_save=false: the copy to host memory and the whole write") + ")",
             f"  previous loop (rollout, pi_old and sync one agent after another): "
             f"{obj['step_time_sequential_s']:.1f} s"]
    off = obj.get("step_time_one_step_off_s")
    if off is not None:
        where = " with engines on GPUs of their own (overlap_plan)" if "overlap_plan" in obj else ""
        lines.append(f"  rollout overlapped (train.rollout_mode one_step_off / async): {off:.1f} s per step{where}")
    elif "overlap_plan" in obj:
        lines.append(f"  rollout overlapped: no plan with separate engines fits ({obj['overlap_plan']['why']})")
    lines.append(f"  GSPOx2 would roll out {g['rollout_s']:.1f} s (step {g['total_s']:.1f} s; HACPO saves "
                 f"{g['hacpo_rollout_saving_s']:.1f} s per step)")
    jobs = obj.get("step_separate_jobs_s") or {}
    if len(jobs) > 1:
        lines.append("  as separate jobs (hacrl train --agent, docs/exchange.md): " + "; ".join(
            f"{name} {j['own_s']:.1f} s alone + {j['barrier_wait_s']:.1f} s waiting for the slowest = {j['step_s']:.1f} s"
            for name, j in jobs.items()))
    for a in obj.get("placement", {}).get("agents", []):
        train = ", ".join(f"node {t['node']} GPUs {t['first_gpu']}-{t['first_gpu'] + t['gpus'] - 1}"
                          for t in a["trainer"])
        eng = ", ".join(f"node {e['node']} GPUs {e['first_gpu']}-{e['first_gpu'] + e['gpus'] - 1}"
                        for e in a["engines"]) or "colocated"
        lines.append(f"  {a['name']}: trainer on {train}; engines: {eng}")
    return lines
