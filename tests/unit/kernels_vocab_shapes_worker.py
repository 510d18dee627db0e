"""Real vocabularies × TP through the Triton kernels' tail geometry, interpreted on CPU; prints JSON.

Executed in a fresh subprocess by ``test_kernels_vocab_shapes.py`` (triton reads
``TRITON_INTERPRET`` when it is imported). For each (model, TP) it pads the vocabulary as the
provider does, and for the first rank and the last rank feeds the kernels a shard with the same
partly empty last block as that rank's real shard under the GPU tile sizes: the kernels treat
every full block alike, so one full 128-column block plus the real tail reproduces what the GPU's
last block sees, at a cost of two blocks instead of V_local/128. Targets are passed both raw
(``global id − shard start``, unclipped, as the kernels received them before the fix) and through
``core.local_target_ids``; each result is compared with the reference backend on the same rows.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from hacrl_megatron.kernels import core, reference  # noqa: E402
from hacrl_megatron.kernels import triton_impl as ti  # noqa: E402
from hacrl_megatron.kernels.vocab_parallel import VocabShard  # noqa: E402
from hacrl_megatron.models.provider import ArchSpec  # noqa: E402

# HF vocabularies (rows of embed_tokens)
VOCABS = {"qwen3": 151936, "llama3": 128256, "qwen2.5": 152064, "smollm2": 49152}
TPS = (1, 2, 4, 8)
N, H = 8, 16

GPU = ti._config(torch.device("cuda"), torch.bfloat16)  # the tiles a bf16 CUDA launch uses (needs no device)
# the interpreter with the GPU's vocab block and split; small row and K tiles keep it fast
ti._config = lambda device, dtype=None: {**GPU, "BLOCK_M": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
torch.set_num_threads(1)


def spec(vocab: int) -> ArchSpec:
    return ArchSpec(arch="llama", hidden_size=H, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=H,
                    ffn_hidden_size=H, vocab_size=vocab, max_position_embeddings=8, rope_theta=1e4,
                    rms_norm_eps=1e-6, tie_embeddings=False)


def rank_check(shard: VocabShard, real_vocab: int) -> dict:
    """Triton vs reference on a reduced shard with this rank's tail geometry."""
    block = GPU["BLOCK_V"]
    tail = shard.valid % block
    rows = block + tail  # one full block + the real partly empty (or absent) last block
    start = shard.start + shard.valid - rows  # global id of the reduced shard's first row
    small = VocabShard(start=start, size=rows, world=shard.world, valid=rows)
    g = torch.Generator().manual_seed(shard.start % 1000)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(rows, H, generator=g)
    nxt = start + rows  # first id of the next rank (when there is one)
    ids = [start, start + rows - 1, start - 1, nxt, nxt + block // 2, nxt + block - tail - 1, nxt + 5 * block,
           start + block]
    targets = torch.tensor([min(max(i, 0), real_vocab - 1) for i in ids])
    raw = targets - start  # the unclipped local ids
    ref = reference.shard_stats(hidden, weight, raw, 1.0, N)
    tail_end = -(-rows // block) * block  # end of the last block's columns, used or not
    out = {"tail": tail, "tail_ids": int(((raw >= rows) & (raw < tail_end)).sum())}
    for name, local in (("raw", raw), ("mapped", core.local_target_ids(targets, small))):
        got = ti.shard_stats(hidden, weight, local, 1.0, N)
        out[f"{name}_finite"] = all(bool(torch.isfinite(t).all()) for t in got)
        out[f"{name}_err"] = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        lse = (ref[0] + ref[1].log()).contiguous()
        scale = torch.linspace(-1, 1, N)
        d_ti = ti.grad_logits_chunk(hidden, weight, local, lse, scale, 1.0)
        d_ref = reference.grad_logits_chunk(hidden, weight, raw, lse, scale, 1.0)
        out[f"{name}_grad_err"] = float((d_ti - d_ref).abs().max())
    return out


def main() -> None:
    result = {}
    for model, vocab in VOCABS.items():
        for tp in TPS:
            padded = spec(vocab).padded_vocab_size(tp)
            v_local = padded // tp
            ranks = sorted({0, tp - 1})
            shards = [VocabShard(start=r * v_local, size=v_local, world=tp,
                                 valid=min(max(vocab - r * v_local, 0), v_local)) for r in ranks]
            result[f"{model}-tp{tp}"] = {
                "padded": padded, "v_local": v_local,
                # the defect's condition: a rank with a partly empty last block and a next rank
                "gpu_tail_before_next_rank": any(s.valid % GPU["BLOCK_V"] and s.start + s.size < padded
                                                 for s in shards),
                "ranks": {str(r): rank_check(s, vocab) for r, s in zip(ranks, shards)},
            }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
