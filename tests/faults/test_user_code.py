"""User code (``data.checker`` / ``hacrl eval --checker``) runs under one timeout everywhere: its
import (checked in a child process), the supervised warm-up, RL scoring and `hacrl eval`. A checker
that never answers stops the command with one line naming it, after a bounded time.

The checkers sleep 30 s (not forever), so that on code without these bounds the commands return
late (or with status 0) and the tests fail instead of hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hacrl_megatron.cli import main
from hacrl_megatron.reward import RewardRequest, VerifierPool, custom
from hacrl_megatron.reward.pool import MAX_USER_TIMEOUTS_IN_A_ROW, UnresponsiveCheckerError
from tests.faults.trainer_helpers import exp_with, preset_file, tiny

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
SLOW_IMPORT = "import time\ntime.sleep(30)\n\ndef score(response, reference):\n    return 1.0\n"
NEVER_ANSWERS = "import time\n\ndef score(response, reference):\n    time.sleep(30)\n    return 1.0\n"


def _checker(tmp_path: Path, body: str, name: str = "check.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return f"{path}:score"


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("hacrl:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_checker_blocking_at_import_stops_config_and_train_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(custom, "IMPORT_TIMEOUT_S", 2.0)
    spec = _checker(tmp_path, SLOW_IMPORT)
    preset = preset_file(tmp_path, tiny(tmp_path, steps=1, every=0))
    for command in ("config", "train"):
        start = time.monotonic()
        assert main([command, "--preset", preset, f"data.checker={spec}"]) == 2
        assert time.monotonic() - start < 20
        line = _one_line(capsys.readouterr().err)
        assert line == (f"hacrl: configuration error: data.checker={spec!r}: importing it did not finish within 2 s; "
                        "a checker module must import without waiting on anything (check what it does at import time)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_checker_that_never_answers_stops_rl_scoring_naming_it(tmp_path, capsys):
    spec = _checker(tmp_path, NEVER_ANSWERS)
    exp = exp_with(tiny(tmp_path, steps=1, every=1), train={"verifier_workers": 2, "verifier_timeout_s": 0.5})
    start = time.monotonic()
    assert main(["train", "--preset", preset_file(tmp_path, exp), f"data.checker={spec}"]) == 2
    assert time.monotonic() - start < 25  # ~4 timeouts of 0.5 s over 2 workers, plus start-up
    line = _one_line(capsys.readouterr().err)
    assert line == (f"hacrl: data.checker={spec!r} answered none of the last {MAX_USER_TIMEOUTS_IN_A_ROW} responses "
                    "within the verifier's timeout (0.5 s each): a checker must return a reward in bounded time; "
                    "stopped")
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))


def test_a_checker_that_never_answers_stops_the_supervised_warm_up(tmp_path):
    """The warm-up scored in-process (no timeout) before; it gets a worker and the run's timeout now."""
    spec = _checker(tmp_path, NEVER_ANSWERS)
    exp = exp_with(tiny(tmp_path, steps=1, every=0), train={"sft_warmup": True, "verifier_timeout_s": 0.5})
    overrides = [f"data.checker={spec}"] + [f"agents.{i}.warmup_sft_max_steps=1" for i in (0, 1)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HACRL_CACHE": str(tmp_path / "cache")}
    try:
        done = subprocess.run([sys.executable, "-m", "hacrl_megatron", "train", "--preset",
                               preset_file(tmp_path, exp), *overrides], capture_output=True, text=True, timeout=120,
                              env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the warm-up hung on a checker that never answers")
    assert done.returncode == 2, done.stderr[-3000:]
    assert _one_line(done.stderr).startswith(f"hacrl: data.checker={spec!r} answered none of the last")


def test_eval_checker_runs_under_the_timeout_even_without_workers(tmp_path, capsys):
    from hacrl_megatron.exchange import load_tokenizer
    from tests.unit.test_rollout_hf import tiny_llama

    tok = load_tokenizer("char", tmp_path / "tok")
    tiny_llama(len(tok)).save_pretrained(tmp_path / "agent")
    tok.save_pretrained(tmp_path / "agent")
    spec = _checker(tmp_path, NEVER_ANSWERS)
    start = time.monotonic()
    assert main(["eval", "--agent", str(tmp_path / "agent"), "--benchmarks", "addition", "--limit", "8",
                 "--max-new-tokens", "3", "--template", "plain", "--checker", spec, "--verifier-workers", "0",
                 "--verifier-timeout-s", "0.5"]) == 2
    assert time.monotonic() - start < 25
    assert _one_line(capsys.readouterr().err).startswith(f"hacrl: --checker={spec!r} answered none of the last")


def test_pool_keeps_user_code_in_a_worker_and_counts_answers_between_timeouts(tmp_path, monkeypatch):
    path = tmp_path / "sometimes.py"
    path.write_text("import os, time\n\ndef score(response, reference):\n"
                    "    if response == 'hang':\n        time.sleep(30)\n"
                    "    return 1.0 if os.getpid() != int(os.environ['HACRL_TEST_PARENT']) else 0.5\n")
    monkeypatch.setenv("HACRL_TEST_PARENT", str(os.getpid()))
    req = lambda text: RewardRequest("math", text, "")  # noqa: E731
    with VerifierPool(num_workers=0, timeout_s=0.5, score_fn=custom.custom_score_fn(f"{path}:score")) as pool:
        assert pool.num_workers == 1
        # an answer resets the count: 3 hangs, an answer, 3 hangs never reach the limit of 4
        assert pool.score([req("hang")] * 3 + [req("ok")] + [req("hang")] * 3) == [0.0] * 3 + [1.0] + [0.0] * 3
        assert pool.stats["timeouts"] == 6
        with pytest.raises(UnresponsiveCheckerError, match=r"answered none of the last 4 responses"):
            pool.score([req("hang")] * MAX_USER_TIMEOUTS_IN_A_ROW)
