"""LocalAgent at TP = PP = DP = 1 in this process (the CPU demo's layout), against HF references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from hacrl_megatron.agents.handle import AgentHandle  # noqa: E402
from hacrl_megatron.agents.local import LocalAgent  # noqa: E402
from hacrl_megatron.config import ModelConfig  # noqa: E402
from hacrl_megatron.models.convert import CheckpointMismatchError  # noqa: E402
from hacrl_megatron.models.parallel import ParallelStateError  # noqa: E402
from tests.distributed.megatron_helpers import (  # noqa: E402
    agent_config,
    hf_reference_step,
    hf_seq_logprobs,
    hf_token_logprobs,
    make_tiny_hf,
    sample_batch,
    sft_loss,
    train_config,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("agent_hf")
    return {arch: (make_tiny_hf(arch, str(root / arch), seed=5), str(root / arch)) for arch in ("llama", "qwen3")}


def test_is_an_agent_handle_and_logprobs_match_hf(hf_dirs):
    hf, path = hf_dirs["qwen3"]
    agent = LocalAgent(agent_config("qwen3", path), train_config(micro_batch_size=3))
    assert isinstance(agent, AgentHandle)
    batch = sample_batch()
    sums, lens = agent.sequence_logprobs(batch, temperature=0.7)
    assert sums.dtype == torch.float32 and torch.equal(lens, batch.response_lens)
    ref = hf_seq_logprobs(hf, batch, temperature=0.7)
    torch.testing.assert_close(sums, ref.detach(), rtol=1e-5, atol=1e-5)
    tok = agent.token_logprobs(batch, temperature=0.7)  # packed per-token values (GRPO's old log-probs)
    assert torch.equal(tok.seq_logp_sum, sums) and tok.cu_seqlens.tolist() == [0, 4, 7, 12, 17]
    torch.testing.assert_close(tok.token_logps, torch.cat(hf_token_logprobs(hf, batch, 0.7)).detach(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro", [1, 4])
def test_one_update_equals_hf_adamw(hf_dirs, micro):
    """Micro-batching must not change the update: loss_fn normalises by the global sequence count."""
    hf, path = hf_dirs["llama"]
    agent = LocalAgent(agent_config("llama", path, lr=1e-3), train_config(micro_batch_size=micro))
    batch = sample_batch()
    (metrics,) = agent.train([batch], sft_loss)
    ref_hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected, norm = hf_reference_step(ref_hf, batch, lr=1e-3)
    for name, tensor in agent.export_hf_weights():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2e-6, msg=name)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics["lr"] == 1e-3 and metrics["m"] == 0.0
    per_seq = hf_seq_logprobs(hf, batch) / batch.response_lens
    assert metrics["loss"] == pytest.approx(float(-(batch.loss_inputs.advantages * per_seq).sum() / 4), rel=1e-5)


def test_training_changes_every_parameter_and_lowers_the_loss():
    agent = LocalAgent(agent_config("qwen3", None, lr=3e-3), train_config(micro_batch_size=2, seed=3), vocab_size=97)
    before = {n: p.detach().clone() for n, p in agent.module.named_parameters()}
    batch = sample_batch(seed=4)
    losses = [agent.train([batch, batch], sft_loss) for _ in range(4)]
    flat = [m["loss"] for step in losses for m in step]
    assert flat[-1] < flat[0] - 0.1, flat
    assert [m["m"] for m in losses[0]] == [0.0, 1.0]  # loss_fn sees the update index m
    unchanged = [n for n, p in agent.module.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    assert agent.updates == 8 and agent.stats()["train_tokens_per_s"] > 0


def test_cosine_schedule_with_warmup():
    agent = LocalAgent(agent_config("llama", None, lr=1e-2),
                       train_config(micro_batch_size=4, lr_warmup_steps=2, lr_schedule="cosine"),
                       vocab_size=97, total_updates=6)
    batch = sample_batch()
    lrs = [m["lr"] for m in agent.train([batch] * 6, sft_loss)]
    assert lrs[:2] == pytest.approx([5e-3, 1e-2])  # warm-up: lr·(u+1)/W
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and lrs[2] > lrs[3] > lrs[4] > lrs[5]


@pytest.mark.parametrize("dist_opt", [False, True])
def test_save_load_restores_model_optimizer_and_schedule(hf_dirs, tmp_path, dist_opt):
    _, path = hf_dirs["llama"]
    agent = LocalAgent(agent_config("llama", path, lr=1e-3, dist_opt=dist_opt), train_config(micro_batch_size=2))
    batch = sample_batch()
    agent.train([batch], sft_loss)
    agent.save(str(tmp_path / "ck"))
    saved = {n: p.detach().clone() for n, p in agent.module.named_parameters()}
    continued = agent.train([batch], sft_loss)[0]
    after_continue = {n: p.detach().clone() for n, p in agent.module.named_parameters()}
    agent.load(str(tmp_path / "ck"))
    assert agent.updates == 1
    for n, p in agent.module.named_parameters():
        assert torch.equal(p, saved[n]), n
    # same Adam moments and step count ⇒ the same update; in-process train_async has already run it
    replay = agent.train_async([batch], sft_loss).result()[0]
    assert replay["loss"] == pytest.approx(continued["loss"], rel=1e-6)
    for n, p in agent.module.named_parameters():
        torch.testing.assert_close(p, after_continue[n], rtol=0, atol=1e-7)


def test_checkpoint_of_another_architecture_is_rejected(hf_dirs, tmp_path):
    _, path = hf_dirs["qwen3"]
    LocalAgent(agent_config("qwen3", path), train_config()).save(str(tmp_path / "q3"))
    llama = LocalAgent(agent_config("llama", hf_dirs["llama"][1]), train_config())
    with pytest.raises(CheckpointMismatchError, match="arch: checkpoint 'qwen3' vs model 'llama'"):
        llama.load(str(tmp_path / "q3"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llama.load(str(tmp_path / "missing"))


def test_two_agents_share_the_process_and_bigger_layouts_are_refused(hf_dirs):
    a = LocalAgent(agent_config("llama", hf_dirs["llama"][1], name="a"), train_config())
    b = LocalAgent(agent_config("qwen3", hf_dirs["qwen3"][1], name="b"), train_config())
    batch = sample_batch()
    la, _ = a.sequence_logprobs(batch)
    b.train([batch], sft_loss)
    la2, _ = a.sequence_logprobs(batch)
    assert torch.equal(la, la2)  # b's update leaves a untouched
    with pytest.raises(ParallelStateError, match="launched in its own world"):
        LocalAgent(agent_config("llama", hf_dirs["llama"][1], tp=2), train_config())


def test_from_hf_model_and_init_checkpoint(hf_dirs, tmp_path):
    hf, path = hf_dirs["qwen3"]
    agent = LocalAgent.from_hf_model(agent_config("qwen3", None), hf, train_cfg=train_config())
    batch = sample_batch()
    ref, _ = agent.sequence_logprobs(batch)
    torch.testing.assert_close(ref, hf_seq_logprobs(hf, batch).detach(), rtol=1e-5, atol=1e-5)
    cfg = agent_config("qwen3", None)
    cfg.model = ModelConfig(arch="qwen3", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=64, vocab_size=97, max_position_embeddings=64, rope_theta=5000.0)
    cfg.init_checkpoint = path  # an HF directory as the starting point
    same, _ = LocalAgent(cfg, train_config()).sequence_logprobs(batch)
    torch.testing.assert_close(same, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_checkpoint_before_the_first_update_restores_a_fresh_optimizer(hf_dirs, tmp_path, dist_opt):
    _, path = hf_dirs["llama"]
    batch = sample_batch()
    agent = LocalAgent(agent_config("llama", path, dist_opt=dist_opt), train_config())
    agent.save(str(tmp_path / "fresh"))
    first = {n: t.clone() for n, t in agent.export_hf_weights()}
    agent.train([batch], sft_loss)
    expected = {n: t.clone() for n, t in agent.export_hf_weights()}
    agent.train([batch], sft_loss)
    agent.load(str(tmp_path / "fresh"))
    assert agent.updates == 0 and all(torch.equal(t, first[n]) for n, t in agent.export_hf_weights())
    agent.train([batch], sft_loss)
    for n, t in agent.export_hf_weights():
        assert torch.equal(t, expected[n]), n


def test_kernel_and_megatron_logprob_paths_agree(hf_dirs):
    """hidden × LM head through hacrl_megatron.kernels == logits + vocab_parallel_cross_entropy."""
    _, path = hf_dirs["qwen3"]
    batch = sample_batch()
    agents = {impl: LocalAgent(agent_config("qwen3", path), train_config(micro_batch_size=3), logprob_impl=impl)
              for impl in ("reference", "megatron")}
    lps = {impl: a.sequence_logprobs(batch, temperature=0.8)[0] for impl, a in agents.items()}
    torch.testing.assert_close(lps["reference"], lps["megatron"], rtol=1e-6, atol=1e-5)
    metrics = {impl: a.train([batch], sft_loss)[0] for impl, a in agents.items()}
    assert metrics["reference"]["grad_norm"] == pytest.approx(metrics["megatron"]["grad_norm"], rel=1e-5)
    w = {impl: dict(a.export_hf_weights()) for impl, a in agents.items()}
    for name, tensor in w["reference"].items():
        torch.testing.assert_close(tensor, w["megatron"][name], rtol=0, atol=1e-6, msg=name)
    bad = sample_batch()
    bad = type(bad)(input_ids=(bad.input_ids[0].clone().fill_(97),) + bad.input_ids[1:], prompt_lens=bad.prompt_lens)
    with pytest.raises(ValueError, match=r"vocab_size=97\); batch has max id 97"):
        agents["megatron"].sequence_logprobs(bad)
    with pytest.raises(ValueError, match="logprob_impl='fast'"):
        LocalAgent(agent_config("qwen3", path), train_config(), logprob_impl="fast")
