"""A checker that ends its worker process on every call (``sys.exit``, ``os._exit``, a SIGKILL of itself)
stops the run with one line naming it, like one that never answers; a checker that starts helper
processes (in its group, or ``setsid`` away) leaves none of them running once its pool is closed."""

from __future__ import annotations

import time

import pytest
import torch

from hacrl_megatron.cli import main
from hacrl_megatron.reward import RewardRequest, VerifierPool, custom
from hacrl_megatron.reward.pool import MAX_USER_TIMEOUTS_IN_A_ROW, UnresponsiveCheckerError
from tests.faults.trainer_helpers import exp_with, preset_file, tiny

torch.set_num_threads(1)

ENDS_ITS_PROCESS = {  # the checker's body, and how the worker's end is named
    "sys.exit": ("import sys\n\ndef score(response, reference):\n    sys.exit(3)\n", "exited with code 3"),
    "os._exit": ("import os\n\ndef score(response, reference):\n    os._exit(0)\n", "exited with code 0"),
    "SIGKILL": ("import os, signal\n\ndef score(response, reference):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
                "was killed by SIGKILL"),
}


@pytest.mark.parametrize("case", list(ENDS_ITS_PROCESS))
def test_a_checker_that_ends_its_worker_on_every_call_stops_the_run_naming_it(tmp_path, capsys, case):
    body, named = ENDS_ITS_PROCESS[case]
    (tmp_path / "check.py").write_text(body)
    spec = f"{tmp_path / 'check.py'}:score"
    exp = exp_with(tiny(tmp_path, steps=2, every=1), train={"verifier_workers": 2, "verifier_timeout_s": 5.0})
    start = time.monotonic()
    assert main(["train", "--preset", preset_file(tmp_path, exp), f"data.checker={spec}"]) == 2
    assert time.monotonic() - start < 60  # 4 worker starts, not one per response (16 per step here)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hacrl:")]
    assert lines == [f"hacrl: data.checker={spec!r} answered none of the last {MAX_USER_TIMEOUTS_IN_A_ROW} responses: "
                     f"its worker process {named} on the last one (sys.exit, os._exit or a crash inside the "
                     "checker); a checker must return a reward and leave its process running; stopped"]
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _left_running(pids: list[int], wait_s: float = 60.0) -> list[int]:
    """The ``pids`` still running after up to ``wait_s``: a SIGKILL takes effect asynchronously, and on a
    loaded machine (load ~7 on two cores) the killed process may wait seconds for a core to exit on; the
    wait ends as soon as none is left."""
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


HELPERS = """import subprocess

def score(response, reference):
    same_group = subprocess.Popen(["sleep", "300"])
    own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open({pids!r}, "a") as f:
        f.write(f"{{same_group.pid}} {{own_session.pid}}\\n")
    return 1.0
"""


def test_helpers_a_checker_starts_end_with_its_pool(tmp_path):
    pids_file = tmp_path / "pids"
    (tmp_path / "helpers.py").write_text(HELPERS.format(pids=str(pids_file)))
    req = RewardRequest("math", "x", "1")
    with VerifierPool(num_workers=2, timeout_s=10.0, score_fn=custom.custom_score_fn(f"{tmp_path}/helpers.py:score")) as pool:
        assert pool.score([req] * 3) == [1.0] * 3
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 6 and all(_alive(p) for p in pids)
    assert not _left_running(pids)


def test_a_replaced_worker_takes_its_helpers_with_it(tmp_path):
    pids_file = tmp_path / "pids"
    body = HELPERS.format(pids=str(pids_file)).replace("    return 1.0\n", "    import os\n    os._exit(1)\n")
    (tmp_path / "helpers.py").write_text(body)
    with VerifierPool(num_workers=1, timeout_s=10.0, score_fn=custom.custom_score_fn(f"{tmp_path}/helpers.py:score")) as pool:
        with pytest.raises(UnresponsiveCheckerError):
            pool.score([RewardRequest("math", "x", "1")] * MAX_USER_TIMEOUTS_IN_A_ROW)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 2 * MAX_USER_TIMEOUTS_IN_A_ROW
        assert not _left_running(pids)  # ended with each dead worker, before the pool closes


def test_helpers_a_checker_starts_at_import_end_with_its_import_check(tmp_path):
    pids_file = tmp_path / "pids"
    (tmp_path / "at_import.py").write_text(
        "import subprocess\n"
        f"_helper = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        f"open({str(pids_file)!r}, 'a').write(f'{{_helper.pid}}\\n')\n\n"
        "def score(response, reference):\n    return 1.0\n")
    custom.check_checker(f"{tmp_path}/at_import.py:score")  # imported in a child process, which has ended
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 1 and not _left_running(pids)
