"""The reference-code parity switches through the real loop (docs/algorithm.md §6-8): the KL penalty
to the starting policy, Naive's plain-merge reading, the self-first mini-batch order and strip_all."""

import dataclasses

import pytest
import torch

from hacrl_megatron.agents.batch import SequenceBatch
from hacrl_megatron.algo import LossInputs
from hacrl_megatron.config import validate
from hacrl_megatron.trainer import stages
from tests.e2e.test_trainer import exported, run_with, split_run, tiny_exp


def parity_exp(path, backend="hf", steps=2, hacpo=None, train=None, rollout=None):
    exp = tiny_exp(path, backend=backend, steps=steps)
    return validate(dataclasses.replace(
        exp, hacpo=dataclasses.replace(exp.hacpo, **(hacpo or {})),
        train=dataclasses.replace(exp.train, **(train or {})), rollout=dataclasses.replace(exp.rollout, **(rollout or {}))))


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_kl_is_zero_before_the_first_update_and_grows_after(tmp_path, backend):
    """One update per step: at step 0 the policy is the reference (KL 0); after it the penalty acts."""
    exp = parity_exp(tmp_path, backend, steps=3, hacpo={"kl_coef": 0.5}, train={"mini_batches": 1})
    run, history = run_with(exp)
    for name in ("llama", "qwen3"):
        assert history[0][f"{name}/kl"] == pytest.approx(0.0, abs=1e-6 if backend == "hf" else 0.0)
        assert history[2][f"{name}/kl"] > 1e-6
        assert history[2][f"{name}/hacpo/kl_penalty"] > 0.0
    _, plain = run_with(parity_exp(tmp_path / "plain", backend, steps=3, train={"mini_batches": 1}))
    assert "llama/kl" not in plain[0]
    assert history[0]["llama/hacpo/loss"] == pytest.approx(plain[0]["llama/hacpo/loss"], abs=1e-6)
    assert history[2]["llama/hacpo/loss"] != pytest.approx(plain[2]["llama/hacpo/loss"], abs=1e-6)
    for rt in run.runtimes:
        rt.close()


def test_kl_reference_survives_a_resume(tmp_path):
    """The reference is the run's starting weights, not the checkpoint's: a resumed run's KL and losses
    equal an unbroken run's."""
    exp = parity_exp(tmp_path / "full", "megatron", steps=4, hacpo={"kl_coef": 0.5})
    _, full = run_with(exp)
    _, _, later = split_run(parity_exp(tmp_path / "split", "megatron", steps=4, hacpo={"kl_coef": 0.5}))
    for a, b in zip(full[2:], later, strict=True):
        for key in ("llama/kl", "qwen3/kl", "llama/hacpo/loss", "qwen3/hacpo/loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert full[3]["llama/kl"] > 0.0


def test_reference_weights_are_the_starting_weights_and_training_weights_come_back(tmp_path):
    exp = parity_exp(tmp_path, "megatron", steps=1, hacpo={"kl_coef": 0.1})
    run, _ = run_with(exp, steps=0)
    rt = run.runtimes[0]
    start = exported(rt)
    from hacrl_megatron.trainer import loop

    loop.train_step(run)
    trained = exported(rt)
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # the step changed the weights
    ids = tuple(torch.tensor(rt.prompt_ids("1+2") + [5, 6, 7]) for _ in range(2))
    batch = SequenceBatch(input_ids=ids, prompt_lens=torch.tensor([len(ids[0]) - 3] * 2))
    ref = rt.trainer.reference_token_logprobs(batch)
    after = exported(rt)
    assert all(torch.equal(trained[k], after[k]) for k in trained)  # swapped back bit for bit
    assert not torch.equal(ref.token_logps, rt.trainer.token_logprobs(batch).token_logps)
    for r in run.runtimes:
        r.close()


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_naive_merge_cross_samples_are_on_policy_at_the_first_update(tmp_path, backend):
    exp = parity_exp(tmp_path, backend, hacpo={"algorithm": "naive_merge"}, train={"mini_batches": 1})
    run, history = run_with(exp)
    tol = 1e-5 if backend == "hf" else 0.0
    for metrics in history:
        for name in ("llama", "qwen3"):
            assert metrics[f"{name}/hacpo/cross_ratio_min"] == pytest.approx(1.0, abs=tol)
            assert metrics[f"{name}/hacpo/cross_ratio_max"] == pytest.approx(1.0, abs=tol)
            assert metrics[f"{name}/hacpo/num_cross"] > 0
    # the generous reading keeps the ratio to the author: far from 1 between these random agents
    _, naive = run_with(parity_exp(tmp_path / "naive", backend, hacpo={"algorithm": "naive"},
                                   train={"mini_batches": 1}))
    assert abs(naive[0]["llama/hacpo/cross_ratio_max"] - 1.0) > 1e-2
    for rt in run.runtimes:
        rt.close()


def test_self_first_order_puts_own_responses_in_the_first_mini_batches():
    own = torch.tensor([False, True, False, True, True, False])
    inputs = LossInputs(advantages=torch.arange(6.0), is_self=own, discrepancy=torch.ones(6),
                        source_logp_sum=torch.zeros(6), source_len=torch.ones(6, dtype=torch.long))
    batch = SequenceBatch(input_ids=tuple(torch.tensor([1, 2, i]) for i in range(6)),
                          prompt_lens=torch.ones(6, dtype=torch.long), loss_inputs=inputs)
    minis = stages.split_mini_batches(batch, 2, seed=0, order="self_first")
    assert [m.loss_inputs.advantages.tolist() for m in minis] == [[1.0, 3.0, 4.0], [0.0, 2.0, 5.0]]
    shuffled = stages.split_mini_batches(batch, 2, seed=0, order="shuffle")
    assert sorted(v for m in shuffled for v in m.loss_inputs.advantages.tolist()) == [0.0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="self_first needs the batch's loss_inputs"):
        stages.split_mini_batches(SequenceBatch(input_ids=batch.input_ids, prompt_lens=batch.prompt_lens), 2, 0,
                                  order="self_first")


def test_paper_parity_mode_trains(tmp_path):
    """KL 1e-3, strip_all and self_first together, as the paper presets set them: every agent trains and
    no view carries an EOS."""
    exp = parity_exp(tmp_path, "megatron", hacpo={"kl_coef": 1e-3}, train={"minibatch_order": "self_first"},
                     rollout={"eos_mode": "strip_all"})
    run, history = run_with(exp)
    before = {rt.name: exported(rt) for rt in run.runtimes}
    assert all(history[-1][f"{n}/hacpo/grad_norm"] > 0 for n in ("llama", "qwen3"))
    prompts = run.task.sample(4, offset=0)
    data = stages.verify(run.verifier, prompts, stages.rollout(run.runtimes, prompts, exp, run.algorithm, 9), 9,
                         exp.rollout.max_response_len + 1)
    for rt in run.runtimes:
        eos = rt.tokenizer.eos_token_id
        for src in run.runtimes:
            views = run.exchange.views(rt.name, data.trajectories[src.name], stages.prompt_id_map(rt, prompts))
            assert all(eos not in v.input_ids[v.prompt_len:] for v in views)
    assert before  # weights exported after training (the agents are live)
    for rt in run.runtimes:
        rt.close()
