"""Overlapped data parallelism on a 2-rank gloo world: ``parallel.overlap_grad_reduce`` (with and without
the distributed optimizer), ``parallel.overlap_param_gather`` and small ``parallel.ddp_bucket_mb`` buckets
train exactly as the plain reduction does.

Two steps of two mini-batches each (one optimizer update per mini-batch), micro-batches of one sequence
(every rank runs several micro-batches, and a different number in each update: ``no_sync`` matters), a model of ~2 MiB of fp32 gradients
cut into 1 MiB buckets (so reductions start bucket by bucket). The comparison is exact: at DP = 2 each
gradient element is the sum of two values whatever the bucketing, and the parameter all-gather copies.
After ``train`` the exported weights and a forward-only pass must already see the last update (the
overlapped gather is completed before anything reads the parameters).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.distributed.megatron_helpers import run_world, sample_batch, sft_loss, tiny_hf_config  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

# (use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather, ddp_bucket_mb)
VARIANTS = {
    "plain": (False, False, False, 0),
    "overlap": (False, True, False, 1),
    "dist_plain": (True, False, False, 0),
    "dist_overlap": (True, True, True, 1),
}
REFERENCE = {"overlap": "plain", "dist_overlap": "dist_plain"}
# Above every gradient norm here: no update is clipped. The distributed optimizer's norm is a sum of
# squares over each rank's shard, and the shards follow the buckets, so the norm differs in the last
# bits (1e-7 relative) between bucketings; a clipped update would carry that difference into the weights.
GRAD_CLIP = 100.0
NORM_RTOL = 1e-6


def _run_variant(name: str, hf_dir: str) -> dict:
    from hacrl_megatron.agents.local import LocalAgent
    from hacrl_megatron.config import AgentConfig, ModelConfig, ParallelConfig, TrainConfig

    dist_opt, overlap_grad, overlap_param, bucket_mb = VARIANTS[name]
    par = ParallelConfig(dp=2, use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap_grad,
                         overlap_param_gather=overlap_param, ddp_bucket_mb=bucket_mb)
    agent = LocalAgent(AgentConfig(name="a", model=ModelConfig(arch="llama", hf_path=hf_dir), lr=1e-3, parallel=par),
                       TrainConfig(micro_batch_size=1, steps=2, mini_batches=2, grad_clip=GRAD_CLIP))
    initial = {k: v.clone() for k, v in agent.export_hf_weights()}
    losses, norms = [], []
    for step in range(2):
        # 3 then 2 micro-batches per rank: megatron's per-parameter ready counts of the first update do
        # not hold for the next, so only no_sync on all but the last micro-batch reduces at the right time
        minis = [sample_batch(seed=10 * step, lens=(7, 5, 9, 6, 8, 4), prompts=(3, 2, 4, 1, 2, 2)),
                 sample_batch(seed=10 * step + 1, lens=(7, 5, 9, 6), prompts=(3, 2, 4, 1))]
        for metrics in agent.train(minis, sft_loss):
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        # read right after train: the weight sync and checkpoints do this
        weights = {k: v.clone() for k, v in agent.export_hf_weights()}
    logps, _ = agent.sequence_logprobs(sample_batch(seed=99))
    buckets = sum(len(b.buckets) for b in agent.model.buffers)
    moved = sum(not torch.equal(initial[k], weights[k]) for k in initial) / len(initial)
    return dict(losses=losses, norms=norms, weights=weights, logps=logps, buckets=buckets, moved=moved)


def _world(rank: int, hf_dir: str) -> dict:
    runs = {name: _run_variant(name, hf_dir) for name in VARIANTS}
    out = {"buckets": {name: r["buckets"] for name, r in runs.items()},
           "moved": {name: r["moved"] for name, r in runs.items()}}
    for name, ref_name in REFERENCE.items():
        run, ref = runs[name], runs[ref_name]
        out[name] = dict(
            losses=run["losses"], ref_losses=ref["losses"], norms=run["norms"], ref_norms=ref["norms"],
            weights_equal=all(torch.equal(run["weights"][k], ref["weights"][k]) for k in ref["weights"]),
            logps_equal=bool(torch.equal(run["logps"], ref["logps"])),
        )
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("ddp overlap")  # a space in the path on purpose
    cfg = tiny_hf_config("llama")
    cfg.hidden_size, cfg.intermediate_size = 128, 512  # ~2 MiB of fp32 gradients: two or more 1 MiB buckets
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(root / "hf"))
    return run_world(_world, 2, (str(root / "hf"),), str(root))


def test_small_buckets_cut_the_gradients(world):
    assert world["buckets"]["plain"] == 1  # megatron's default: 40M parameters, one bucket here
    assert world["buckets"]["overlap"] >= 2 and world["buckets"]["dist_overlap"] >= 2


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_overlapped_reduction_trains_exactly_as_the_plain_one(world, name):
    res = world[name]
    assert len(res["losses"]) == 4
    assert res["losses"] == res["ref_losses"]
    if name.startswith("dist"):  # the norm's sum runs over differently cut shards (see GRAD_CLIP)
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=NORM_RTOL)
    else:
        assert res["norms"] == res["ref_norms"]
    assert res["weights_equal"], "exported weights differ from the plain reduction's"
    assert res["logps_equal"], "a forward after train did not see the last update"


def test_the_updates_change_the_weights(world):
    assert all(moved == 1.0 for moved in world["moved"].values()), world["moved"]  # every exported tensor
    assert all(0 < n < GRAD_CLIP for n in world["overlap"]["ref_norms"])
