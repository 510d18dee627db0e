"""``hacrl train --preset cpu_demo rollout.engine=sglang`` against real SGLang 0.5.23 servers on CPU
(``rollout.sglang.cpu``), with the Megatron agents, 3 steps, once per weight transport: ``distributed``
(a gloo broadcast from the trainer inside SGLang's weight-update session) and ``disk``. After every
step's sync the loop's post-sync check must hold (below 1e-3 nats per token, both agents).

The servers run with an API key: afterwards no file of the run folder and nothing the run printed
holds the key, and the servers' logs (where SGLang prints its arguments) are 0600 and redacted.

Slow (two servers start per run: minutes on 2 shared cores); ``.ci/sglang.sh test`` runs it with
``HACRL_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.fixtures.sglang_env import sglang_python_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.timeout(3600),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
pytest.importorskip("megatron.core")


@pytest.mark.parametrize("weight_sync", ["distributed", "disk"])
def test_hacrl_train_cpu_demo_with_real_sglang_servers_runs_three_steps(tmp_path, capfd, weight_sync):
    from hacrl_megatron.cli import main

    python = sglang_python_or_skip()
    secret = "sglang-e2e-" + "s3" * 10
    key_file = tmp_path / "api_key"  # outside the run folder
    key_file.write_text(secret + "\n")
    out = tmp_path / "run"
    t0 = time.perf_counter()
    rc = main(["train", "--preset", "cpu_demo", "rollout.engine=sglang", "rollout.sglang.cpu=true",
               f"rollout.sglang.python={python}", f"rollout.sglang.api_key_file={key_file}",
               f"rollout.weight_sync={weight_sync}", "train.sft_warmup=false", "train.steps=3",
               "train.prompts_per_step=8", "train.eval_every=0", "checkpoint.every=0", "log.tensorboard=false",
               "log.progress=false", f"output_dir={out}"])
    seconds = time.perf_counter() - t0
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "llama/sync_logp_diff" in r]
    assert len(steps) == 3
    for row in steps:
        for name in ("llama", "qwen3"):
            assert row[f"{name}/sync_logp_diff"] < 1e-3  # the loop's post-sync check held at every sync
            assert row[f"{name}/rollout_tokens_per_s"] > 0
    if weight_sync == "disk":
        for name in ("llama", "qwen3"):
            assert sorted(p.name for p in (out / "engines" / name / "synced").iterdir()) == ["v3"]
    printed, errors = capfd.readouterr()
    assert secret not in printed + errors
    files = [p for p in Path(out).rglob("*") if p.is_file() and not p.is_symlink()]
    assert [p for p in files if secret.encode() in p.read_bytes()] == []
    logs = [p for p in files if p.name.startswith("server") and p.suffix == ".log"]
    assert len(logs) == 2 and all(p.stat().st_mode & 0o777 == 0o600 for p in logs)
    assert all("<api-key redacted>" in p.read_text() for p in logs)  # SGLang printed it; the pipe redacted it
    with capfd.disabled():
        print(f"\nhacrl train cpu_demo rollout.engine=sglang weight_sync={weight_sync}: {seconds:.0f} s; "
              + ", ".join(f"step {i}: sync diff {r['llama/sync_logp_diff']:.1e} / {r['qwen3/sync_logp_diff']:.1e}, "
                          f"{r['llama/rollout_tokens_per_s']:.0f} / {r['qwen3/rollout_tokens_per_s']:.0f} tok/s"
                          for i, r in enumerate(steps)))
