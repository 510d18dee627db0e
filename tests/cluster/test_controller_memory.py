"""No model on the controller: building a Megatron agent with server engines from a multi-GB HF folder
keeps the controller's peak memory at its baseline.

The checkpoint is synthetic: a Llama config of 1.4 B parameters and one bf16 safetensors file of
2.8 GB (a valid header; the data region is a sparse file, so it costs no disk and reads as zeros).
The controller runs in a fresh process and calls ``trainer.runtime.build_runtime`` as the trainer
does. What runs elsewhere on a cluster is stood in for: the agent's Ray ranks by a recorder of what
they are handed (they would read their own shards of the folder), the SGLang server by a process
that answers /health (it would load the folder). The bound: the controller's peak RSS may grow by at
most 256 MB over its RSS after imports, a tenth of the checkpoint; loading the model as before (an
fp32 HF model, 5.6 GB) or even reading the file once (2.8 GB) would exceed it many times over.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BOUND_MB = 256
HIDDEN, FFN, LAYERS, VOCAB, HEADS, KV_HEADS = 2048, 5632, 24, 32000, 16, 16


def llama_tensor_shapes() -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN],
              "lm_head.weight": [VOCAB, HIDDEN]}
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [HIDDEN], p + "post_attention_layernorm.weight": [HIDDEN],
                       p + "self_attn.q_proj.weight": [HIDDEN, HIDDEN], p + "self_attn.k_proj.weight": [kv, HIDDEN],
                       p + "self_attn.v_proj.weight": [kv, HIDDEN], p + "self_attn.o_proj.weight": [HIDDEN, HIDDEN],
                       p + "mlp.gate_proj.weight": [FFN, HIDDEN], p + "mlp.up_proj.weight": [FFN, HIDDEN],
                       p + "mlp.down_proj.weight": [HIDDEN, FFN]})
    return shapes


def write_sparse_checkpoint(folder: Path) -> int:
    """An HF Llama folder whose safetensors data is a hole; returns the file's size in bytes."""
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in llama_tensor_shapes().items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)  # the data region: a hole
    return path.stat().st_size


HEALTH_SERVER = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    host, port = sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    ThreadingHTTPServer((host, port), H).serve_forever()
""")

CONTROLLER = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, {root!r})
    from hacrl_megatron.config import from_dict, validate
    from hacrl_megatron.config.schema import ExperimentConfig
    import hacrl_megatron.agents.ray_agent as ray_agent
    from hacrl_megatron.trainer import runtime

    handed = {{}}

    class RanksStandIn:  # the agent's Ray ranks: records what they would be given
        runs_in_process = False
        def __init__(self, agent_cfg, train_cfg, *, hf_checkpoint=None, hf_config=None, **kw):
            handed.update(checkpoint=hf_checkpoint, type=type(hf_checkpoint).__name__,
                          hidden=hf_config.hidden_size)
        def close(self):
            pass

    ray_agent.RayAgent = RanksStandIn
    exp = validate(from_dict(ExperimentConfig, json.loads({exp!r})))
    import torch, transformers  # everything the controller imports, before the baseline
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rt = runtime.build_runtime(exp, 0, total_updates=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    init = rt.engine.slots[0].engine.server.model_path
    rt.close()
    print(json.dumps({{"baseline_kb": baseline, "peak_kb": peak, "handed": handed, "init": str(init)}}))
""")


def test_controller_peak_rss_stays_at_baseline_on_a_multi_gb_checkpoint(tmp_path):
    folder = tmp_path / "llama-1b4"
    size = write_sparse_checkpoint(folder)
    assert size > 2.5e9
    server = tmp_path / "health_server.py"
    server.write_text(HEALTH_SERVER)
    exp = {
        "name": "rss", "output_dir": str(tmp_path / "run"),
        "agents": [{"name": "big", "backend": "megatron", "workers": "ray", "tokenizer": "char",
                    "prompt_template": "plain", "parallel": {"tp": 2},
                    "model": {"arch": "llama", "hf_path": str(folder)}}],
        "rollout": {"engine": "sglang", "weight_sync": "distributed",
                    "sglang": {"command": [sys.executable, str(server), "--host", "{host}", "--port", "{port}"]}},
        "hacpo": {"algorithm": "gspo"},
        "train": {"verifier_workers": 0, "eval_every": 0}, "data": {"eval_size": 0},
        "log": {"tensorboard": False, "progress": False},
    }
    script = CONTROLLER.format(root=str(ROOT), exp=json.dumps(exp))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    grown_mb = (out["peak_kb"] - out["baseline_kb"]) / 1024
    assert grown_mb < BOUND_MB, f"controller peak RSS grew by {grown_mb:.0f} MB on a {size / 1e9:.1f} GB checkpoint"
    # the ranks get the folder's path (each reads its own shards), never tensors
    assert out["handed"] == {"checkpoint": str(folder), "type": "str", "hidden": HIDDEN}
    # the engine loads the folder itself: its init folder links the weights, nothing was copied
    init = Path(out["init"])
    assert (init / "model.safetensors").is_symlink()
    assert (init / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    print(f"controller RSS: baseline {out['baseline_kb'] / 1024:.0f} MB, peak {out['peak_kb'] / 1024:.0f} MB "
          f"(+{grown_mb:.0f} MB) on a {size / 1e9:.2f} GB checkpoint")
