"""RayAgent: TP = 2 and PP = 2 worlds of Ray actors (gloo) against a TP = 1 LocalAgent.

One private Ray instance per module (4 logical CPUs on the 2-core CI machine: each rank is mostly
idle waiting on gloo). Each layout builds one RayAgent and runs every check on it, because
starting a world costs ~10 s of imports:

* sequence log-probs equal the in-process TP = 1 LocalAgent built from the same HF weights;
* one train() update gives the same loss, grad norm and exported HF weights;
* save → another update → load restores the saved log-probs, and the checkpoint also loads into
  the TP = 1 LocalAgent (reshardable); a flipped byte in a shard is named on load, and the agent
  then loads the intact checkpoint;
* failures name the agent and rank: a killed rank, an exception inside loss_fn, a layout larger
  than the cluster.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from hacrl_megatron.agents.checkpoint_io import DigestMismatchError  # noqa: E402
from hacrl_megatron.agents.ray_agent import RayAgent, RayAgentError, build_ray_agent  # noqa: E402
from hacrl_megatron.agents.ray_placement import rank_envs, rank_order, require_ray  # noqa: E402
from hacrl_megatron.agents.ray_worker import SharedStateDict  # noqa: E402
from tests.distributed.megatron_helpers import (  # noqa: E402
    agent_config,
    make_tiny_hf,
    sample_batch,
    sft_loss,
    start_local_ray,
    train_config,
)

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
LR = 1e-3
QUIET = {"PYTHONWARNINGS": "ignore"}
CPU = {"use_gpu": False, "env_vars": QUIET}  # gloo ranks even where the Ray cluster has GPUs


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    start_local_ray()
    yield
    ray.shutdown()


def _reference(arch: str, hf_model, batch) -> dict:
    """TP = 1 LocalAgent in this process: log-probs, one update (metrics, exported weights)."""
    from hacrl_megatron.agents.local import LocalAgent

    local = LocalAgent.from_hf_model(agent_config(arch, lr=LR), hf_model, train_cfg=train_config())
    logprobs, lens = local.sequence_logprobs(batch)
    tokens = local.token_logprobs(batch)
    (metrics,) = local.train([batch], sft_loss)
    return {"logprobs": logprobs, "lens": lens, "tokens": tokens, "metrics": metrics,
            "weights": dict(local.export_hf_weights())}


def _check_against_reference(agent: RayAgent, ref: dict, batch, tol: float = 1e-5) -> None:
    logprobs, lens = agent.sequence_logprobs(batch)
    torch.testing.assert_close(logprobs, ref["logprobs"].cpu(), rtol=tol, atol=tol)
    assert torch.equal(lens, ref["lens"])
    tokens = agent.token_logprobs(batch)  # GRPO's per-token old log-probs
    torch.testing.assert_close(tokens.token_logps.cpu(), ref["tokens"].token_logps.cpu(), rtol=tol, atol=tol)
    assert torch.equal(tokens.cu_seqlens.cpu(), ref["tokens"].cu_seqlens.cpu())
    (metrics,) = agent.train([batch], sft_loss)
    assert metrics["loss"] == pytest.approx(ref["metrics"]["loss"], rel=tol)
    assert metrics["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=tol)
    assert metrics["lr"] == ref["metrics"]["lr"] == LR
    exported = dict(agent.export_hf_weights())
    assert set(exported) == set(ref["weights"])
    # Adam's first step moves a weight by lr·g/(|g| + eps): where |g| ~ eps the TP = 2 vs TP = 1
    # summation-order noise decides the step (measured: 1 of 20k weights off by 2.5e-5), so allow a
    # few such weights, bounded by the step size itself; a wrong shard or tensor moves thousands.
    errors = torch.cat([(exported[k].cpu() - ref["weights"][k].cpu()).abs().flatten() for k in exported])
    assert int((errors > 1e-2 * LR).sum()) <= 1e-3 * errors.numel(), errors.topk(5).values
    assert float(errors.max()) <= 2 * LR
    assert agent.stats()["updates"] == 1.0


def test_tp2_ray_agent_equals_tp1_local_and_checkpoints(tmp_path):
    hf = make_tiny_hf("llama", str(tmp_path / "hf"), seed=3)
    batch = sample_batch()
    ref = _reference("llama", hf, batch)
    agent = build_ray_agent(agent_config("llama", tp=2, lr=LR), hf, train_config(), None, **CPU)
    try:
        assert [i["tp_rank"] for i in agent.infos] == [0, 1] and agent.num_parameters() > 0
        _check_against_reference(agent, ref, batch)
        agent.bucket_bytes = 4096  # many small buckets: the stream must still be complete and in order
        assert [n for n, _ in agent.export_hf_weights()] == list(ref["weights"])
        next(iter(agent.export_hf_weights()))  # abandoned mid-stream: the next export starts afresh
        assert [n for n, _ in agent.export_hf_weights()] == list(ref["weights"])
        saved_lp, _ = agent.sequence_logprobs(batch)
        digests = agent.save(str(tmp_path / "ck"))  # both ranks' files, hashed as written
        assert {name for name in digests if name.endswith(".distcp")} == {
            p.name for p in (tmp_path / "ck").glob("*.distcp")}
        pending = agent.train_async([batch], sft_loss)  # returns at once; the ranks update meanwhile
        assert pending.result()[0]["lr"] == LR
        assert not torch.allclose(agent.sequence_logprobs(batch)[0], saved_lp, atol=1e-5)
        shutil.copytree(tmp_path / "ck", tmp_path / "flipped")
        shard = sorted((tmp_path / "flipped").glob("*.distcp"))[-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(DigestMismatchError, match=rf"{shard.name} does not match its SHA-256"):
            agent.load(str(tmp_path / "flipped"), digests)  # found by the rank that reads it ...
        agent.load(str(tmp_path / "ck"), digests)  # ... and the agent's world is still there to load the good one
        torch.testing.assert_close(agent.sequence_logprobs(batch)[0], saved_lp, rtol=1e-6, atol=1e-6)
        assert agent.stats()["updates"] == 1.0

        from hacrl_megatron.agents.local import LocalAgent

        local = LocalAgent.from_hf_model(agent_config("llama", lr=LR), hf, train_cfg=train_config())
        local.load(str(tmp_path / "ck"))  # written by two ranks at TP = 2, read at TP = 1
        torch.testing.assert_close(local.sequence_logprobs(batch)[0], saved_lp, rtol=1e-6, atol=1e-6)

        ray.kill(agent._workers[1], no_restart=True)
        with pytest.raises(RayAgentError, match=r"agent 'a': worker of rank 1/2 died during sequence_logprobs"):
            agent.sequence_logprobs(batch)
        with pytest.raises(RayAgentError, match="is shut down"):
            agent.stats()
    finally:
        agent.close()


def test_pp2_ray_agent_equals_tp1_local_and_names_failing_rank(tmp_path):
    hf = make_tiny_hf("qwen3", str(tmp_path / "hf"), seed=4)
    batch = sample_batch(seed=5)
    ref = _reference("qwen3", hf, batch)
    agent = RayAgent.from_hf_model(agent_config("qwen3", pp=2, lr=LR, name="q"), hf, train_cfg=train_config(), **CPU)
    try:
        assert [i["pp_rank"] for i in agent.infos] == [0, 1]
        _check_against_reference(agent, ref, batch)

        def bad_loss(lp, inputs, info):
            raise ValueError("loss exploded")

        # the loss runs on the last stage only: rank 1 raises, rank 0 would wait in a p2p forever
        with pytest.raises(ValueError, match="loss exploded") as info:
            agent.train([batch], bad_loss)
        assert any("agent 'q': raised on rank 1 during train" in n for n in info.value.__notes__)
        with pytest.raises(RayAgentError, match="agent 'q' is shut down"):
            agent.sequence_logprobs(batch)
    finally:
        agent.close()
    assert not agent._workers and agent._pg is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ranks_get_one_gpu_each_and_match_local(tmp_path):
    """GPU bundles + nccl: TP over two GPUs (one GPU: TP = 1), each rank remapped to its own device."""
    tp = 2 if torch.cuda.device_count() >= 2 else 1
    hf = make_tiny_hf("llama", str(tmp_path / "hf"), seed=3)
    batch = sample_batch()
    ref = _reference("llama", hf, batch)  # LocalAgent on this process's GPU
    agent = build_ray_agent(agent_config("llama", tp=tp, lr=LR, name="g"), hf, train_config(), None, use_gpu=True,
                            env_vars=QUIET)
    try:
        assert [i["tp_rank"] for i in agent.infos] == list(range(tp))
        _check_against_reference(agent, ref, batch, tol=1e-4)  # GPU kernels sum in other orders
        assert agent.stats()["peak_cuda_mib"] > 0
    finally:
        agent.close()


def test_layout_larger_than_cluster_is_refused_naming_agent_and_resources():
    with pytest.raises(RayAgentError, match=r"agent 'big' \(tp=2, pp=2, dp=2: 8 ranks\).*CPU: needs 8, cluster has 4"):
        RayAgent(agent_config("llama", tp=2, pp=2, dp=2, name="big"), train_config(), use_gpu=False)


def test_call_timeout_names_the_late_ranks_and_releases_the_placement():
    from ray.util.placement_group import placement_group_table

    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    # starting an actor process takes seconds: a 0.2 s limit expires while the ranks start
    with pytest.raises(RayAgentError, match=r"agent 't': start did not finish within 0.2 s on ranks \[0, 1\]"):
        RayAgent(agent_config("llama", tp=2, name="t"), train_config(), call_timeout_s=0.2, use_gpu=False)
    after = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    assert after == before


def test_missing_ray_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install ray"):
        require_ray()


def test_rank_envs_keep_node_ranks_contiguous_and_gpus_visible():
    infos = [{"ip": "10.0.0.1", "gpu_ids": ["3"]}, {"ip": "10.0.0.1", "gpu_ids": ["5"]},
             {"ip": "10.0.0.2", "gpu_ids": ["0"]}]
    envs = rank_envs(infos, "10.0.0.1", 29500)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "3,5", "0"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and envs[2]["WORLD_SIZE"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in rank_envs([{"ip": "h", "gpu_ids": []}], "h", 1)[0]


def test_shared_state_dict_round_trips_every_dtype_bit_exactly():
    state = {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "h": torch.randn(2, 2).half().t()}
    packed = SharedStateDict.from_tensors(state)
    back = ray.get(ray.put(packed)).to_tensors()  # through the object store, as the ranks receive it
    assert set(back) == set(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_rank_order_groups_bundles_by_node():
    infos = [{"ip": "b"}, {"ip": "a"}, {"ip": "b"}, {"ip": "a"}]
    assert rank_order(infos) == [0, 2, 1, 3]
