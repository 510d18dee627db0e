"""The megatron-core steps of ``benchmarks/gpu_check.sh`` (need the carried megatron-core wheel):
``GPTModel`` forward/backward on CUDA vs CPU, one ``LocalAgent`` update through the fused loss, and the
device memory trainer offload frees for colocated engines (:func:`colocation_memory`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from gpu_check_common import ROOT, SITE, check, err, need, need_cuda, record


def tiny_hf_config(vocab: int = 256) -> SimpleNamespace:
    """A qwen3-shaped HF config without transformers (arch_from_hf reads attributes only)."""
    return SimpleNamespace(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=vocab,
                           max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                           tie_word_embeddings=False, hidden_act="silu", architectures=["Qwen3ForCausalLM"])


def gpt_forward_backward(model, device) -> dict:
    """Logits of a fixed batch and the gradients of a fixed weighting of them."""
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 24), generator=g).to(device)
    weights = torch.randn(2, 24, 256, generator=g).to(device)
    positions = torch.arange(24, device=device).unsqueeze(0).expand(2, -1)
    model.zero_grad()
    logits = model(tokens, positions, None)
    (logits.float() * weights).sum().backward()
    grads = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().cpu()
             for n, p in model.named_parameters()}
    return {"logits": logits.detach().float().cpu(), "grads": grads}


def step_megatron_cpu(path: str) -> str:
    """Child of :func:`step_megatron` (CUDA hidden): the GPTModel on CPU, its weights and results saved."""
    import torch

    from hacrl_megatron.models.parallel import init_parallel
    from hacrl_megatron.models.provider import arch_from_hf, build_gpt_model

    init_parallel(1, 1, 1, seed=0)
    model = build_gpt_model(arch_from_hf(tiny_hf_config()), te=False)
    torch.save({"state": model.state_dict(), **gpt_forward_backward(model, "cpu")}, path)
    return "saved"


def step_megatron() -> str:
    """megatron-core's GPTModel (local spec, fp32) forward and backward on CUDA vs the same weights on CPU."""
    need_cuda()
    need("megatron.core", "carry the megatron-core wheel, and any of numpy/packaging missing here, in .whl/: "
                         "see the header")
    import torch

    from hacrl_megatron.models.parallel import init_parallel
    from hacrl_megatron.models.provider import arch_from_hf, build_gpt_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "cpu.pt")
        paths = [str(ROOT), str(SITE), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(paths)}
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check_steps.py"), "megatron_cpu", path], env=env, capture_output=True,
                             text=True, timeout=45)
        check(res.returncode == 0, f"CPU model: {(res.stdout + res.stderr).strip().splitlines()[-1:]}")
        cpu = torch.load(path, weights_only=False)
    import megatron.core

    init_parallel(1, 1, 1, seed=0)
    model = build_gpt_model(arch_from_hf(tiny_hf_config()), te=False)
    model.load_state_dict(cpu["state"])
    cuda = gpt_forward_backward(model, "cuda")
    scale = float(cpu["logits"].abs().max())
    d_logits = err(cuda["logits"], cpu["logits"])
    d_grads = max(err(cuda["grads"][n], g) / max(float(g.abs().max()), 1e-12) for n, g in cpu["grads"].items())
    record("megatron", {"version": megatron.core.__version__, "logits_max_abs_diff": d_logits, "logits_scale": scale,
                        "grads_max_rel_diff": d_grads, "parameters": len(cpu["grads"])})
    check(d_logits < 1e-4 * max(scale, 1.0) and d_grads < 1e-3, f"CUDA vs CPU: logits {d_logits:.1e}, grads "
                                                                 f"(relative) {d_grads:.1e}")
    return (f"megatron-core {megatron.core.__version__} GPTModel (local spec, fp32): CUDA = CPU, logits "
            f"{d_logits:.1e} (scale {scale:.1f}), grads of {len(cpu['grads'])} tensors rel. {d_grads:.1e}")


def agent_compare(fused: str = "triton", peer: str = "megatron") -> dict:
    """Two LocalAgents with the same weights, log-probs through ``fused`` (kernel from hidden states)
    and ``peer`` (megatron's vocab-parallel CE): their log-probs, then one HACPO update each."""
    import torch

    from hacrl_megatron.agents.batch import SequenceBatch
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.algo import LossInputs, hacpo_loss
    from hacrl_megatron.config import AgentConfig, HACPOConfig, ModelConfig, ParallelConfig, TrainConfig

    def loss_fn(lp, inputs, info):
        return hacpo_loss(lp.seq_logp_sum, lp.seq_len, inputs, info.update_index, HACPOConfig(), info.num_sequences)

    cfg = AgentConfig(name="gpu", model=ModelConfig(arch="qwen3"), lr=1e-3)
    agents = {impl: LocalAgent(cfg, TrainConfig(micro_batch_size=2, seed=0), hf_config=tiny_hf_config(),
                               logprob_impl=impl) for impl in (fused, peer)}
    # megatron-core's overlapped DDP on CUDA (backward hooks, async reduction, the distributed
    # optimizer's gather in the next forward, completed at the end of train): the fused agent's update
    overlapped = dataclasses.replace(cfg, parallel=ParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_mb=1))
    agents["overlap"] = LocalAgent(overlapped, TrainConfig(micro_batch_size=2, seed=0), hf_config=tiny_hf_config(),
                                   logprob_impl=fused)
    for other in (peer, "overlap"):
        agents[other].module.load_state_dict(agents[fused].module.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = tuple(torch.randint(0, 256, (n,), generator=g) for n in (9, 17, 12, 30))
    probe = SequenceBatch(input_ids=ids, prompt_lens=torch.tensor([3, 5, 2, 8]))
    sums = {k: a.sequence_logprobs(probe)[0].cpu() for k, a in agents.items()}
    inputs = LossInputs(source_logp_sum=sums[fused] + torch.tensor([0.0, -0.3, 0.0, 0.2]),
                        source_len=probe.response_lens, advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]),
                        is_self=torch.tensor([True, False, True, False]), discrepancy=torch.tensor([1.0, 1.5, 1.0, 0.8]))
    batch = SequenceBatch(input_ids=ids, prompt_lens=probe.prompt_lens, loss_inputs=inputs)
    before = {n: p.detach().clone() for n, p in agents[fused].module.named_parameters()}
    metrics = {k: a.train([batch], loss_fn)[0] for k, a in agents.items()}
    moved = sum(not torch.equal(p, before[n]) for n, p in agents[fused].module.named_parameters())
    after = dict(agents["overlap"].module.named_parameters())
    overlap_diff = max(float((p - after[n]).abs().max()) for n, p in agents[fused].module.named_parameters())
    return {"device": str(next(agents[fused].module.parameters()).device), "logp_diff": err(sums[fused], sums[peer]),
            "overlap_param_diff": overlap_diff, "overlap_loss_diff": abs(metrics[fused]["loss"] - metrics["overlap"]["loss"]),
            "loss_diff": abs(metrics[fused]["loss"] - metrics[peer]["loss"]),
            "grad_norm_rel_diff": abs(metrics[fused]["grad_norm"] - metrics[peer]["grad_norm"])
            / metrics[peer]["grad_norm"], "moved": moved, "parameters": len(before), "metrics": metrics}


def colocation_memory(hidden: int = 768, layers: int = 4, vocab: int = 32000) -> dict:
    """The device memory free where colocated engines resume (trainer/colocation.py), with and without
    trainer offload: one bf16 LocalAgent (distributed optimizer) after an update, free device memory
    (``torch.cuda.mem_get_info``, MiB: what another process can take) as it was (``resident``: nothing
    emptied, the loop before colocate_offload), after ``sleep("none")`` (the CUDA cache emptied), after
    ``sleep("optimizer")`` (where the engines resume their weights) and ``sleep("all")`` (where they
    resume the KV cache), and after the wake; the MiB parked per level, whether the host buffers are
    pinned, whether every tensor came back bit-identical and an update after the wake is finite."""
    import torch

    from hacrl_megatron.agents.batch import SequenceBatch
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.algo import LossInputs
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig

    def loss_fn(lp, inputs, info):
        loss = -(inputs.advantages * lp.seq_logp_sum / lp.seq_len).sum() / info.num_sequences
        return loss, {}

    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=hidden // 8, intermediate_size=4 * hidden, vocab_size=vocab)
    cfg = AgentConfig(name="colocated", model=ModelConfig(arch="qwen3", dtype="bfloat16"), lr=1e-4,
                      parallel=ParallelConfig(use_distributed_optimizer=True))
    agent = LocalAgent(cfg, TrainConfig(micro_batch_size=2, seed=0),
                       hf_config=SimpleNamespace(**{**vars(tiny_hf_config(vocab)), **shape}))
    g = torch.Generator().manual_seed(2)
    ids = tuple(torch.randint(0, vocab, (n,), generator=g) for n in (40, 64, 52, 33))
    n = len(ids)
    inputs = LossInputs(source_logp_sum=torch.zeros(n), source_len=torch.full((n,), 10),
                        advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]), is_self=torch.ones(n, dtype=torch.bool),
                        discrepancy=torch.ones(n))
    batch = SequenceBatch(input_ids=ids, prompt_lens=torch.tensor([3, 5, 2, 8]), loss_inputs=inputs)
    agent.train([batch], loss_fn)
    parking = agent._parking()
    snapshot = {k: s.cpu().clone() for k, s in _storage_bytes(parking).items()}

    def free_mib() -> float:  # NaN on CPU, where tests run this body for API drift
        if not torch.cuda.is_available():
            return float("nan")
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0] / 2**20

    free = {"resident": free_mib()}
    parked = {}
    for level in ("none", "optimizer", "all"):
        agent.sleep(level)
        free[level] = free_mib()
        parked[level] = agent.stats().get("offload_mib", 0.0) if level != "none" else 0.0
    pinned = all(p.host.is_pinned() == torch.cuda.is_available() for p in parking._parked.values())
    agent.wake()
    free["awake_again"] = free_mib()
    identical = all(torch.equal(snapshot[k], s.cpu()) for k, s in _storage_bytes(parking).items())
    (after,) = agent.train([batch], loss_fn)
    return {"free_mib": free, "parked_mib": parked, "pinned_when_cuda": pinned, "identical": identical,
            "storages": len(snapshot), "update_after_wake_finite": bool(torch.isfinite(torch.tensor(after["loss"]))),
            "parameters": agent.num_parameters()}


def _storage_bytes(parking) -> dict:
    """Every storage of the agent's model and training state as a uint8 tensor over its bytes."""
    from hacrl_megatron.agents.offload import _bytes_of

    storages = {**parking._storages(parking._model_tensors()), **parking._storages(parking._training_tensors())}
    return {k: _bytes_of(s) for k, s in storages.items()}


def step_agent() -> str:
    """One LocalAgent HACPO update on CUDA through the fused Triton loss, against the same agent with
    megatron's vocab-parallel cross entropy (same weights): log-probs, loss, grad norm; every parameter moves."""
    need_cuda()
    need("megatron.core", "carry the megatron-core wheel, and any of numpy/packaging missing here, in .whl/: "
                         "see the header")
    data = agent_compare("triton", "megatron")
    record("agent", data)
    d_logp, d_loss, d_norm, moved, total = (data[k] for k in ("logp_diff", "loss_diff", "grad_norm_rel_diff", "moved",
                                                               "parameters"))
    check(data["device"].startswith("cuda"), f"the agent's parameters are on {data['device']}")
    check(moved == total, f"{total - moved} of {total} parameters did not change")
    check(d_logp < 1e-4 and d_loss < 1e-5 and d_norm < 1e-4, f"fused Triton vs megatron CE: logp {d_logp:.1e}, "
                                                              f"loss {d_loss:.1e}, grad norm (rel.) {d_norm:.1e}")
    d_overlap = data["overlap_param_diff"]
    check(d_overlap < 1e-6 and data["overlap_loss_diff"] < 1e-6,
          f"overlapped DDP + distributed optimizer vs plain: parameters {d_overlap:.1e}, "
          f"loss {data['overlap_loss_diff']:.1e}")
    # colocation: the device memory free where the engines resume, with and without trainer offload
    memory = colocation_memory()
    record("agent_offload", memory)
    free, parked = memory["free_mib"], memory["parked_mib"]
    check(memory["identical"] and memory["update_after_wake_finite"], "offload: the state after the wake differs")
    check(free["all"] - free["none"] >= 0.95 * parked["all"], f"offload all parked {parked['all']:.0f} MiB, freed "
          f"{free['all'] - free['none']:.0f} MiB")
    return (f"LocalAgent HACPO update on CUDA, fused Triton loss = megatron CE: logp {d_logp:.1e}, loss "
            f"{d_loss:.1e}, grad norm {d_norm:.1e} (rel.); {moved}/{total} parameters moved; overlapped DDP "
            f"(overlap_grad_reduce, overlap_param_gather) = plain: parameters {d_overlap:.1e}; colocation, free MiB "
            f"at engine resume ({memory['parameters'] / 1e6:.0f}M-param bf16 agent): none {free['none']:.0f}, "
            f"optimizer {free['optimizer']:.0f}, all {free['all']:.0f} (+{free['all'] - free['resident']:.0f}), "
            "wake bit-identical")
