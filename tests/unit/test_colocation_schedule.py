"""The colocation schedule (trainer/colocation.py) through the trainer loop: a tiny two-agent run whose
engines and trainers are wrapped to record every turn (trainer sleep and wake, engine resume,
generate, release, weight push, probes). The recorded order is the documented one; the trainers
really offload (a call that read parked state would raise); and the colocated run's losses, rewards
and sync checks equal those of the same run without colocation, step for step."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from hacrl_megatron.reward.pool import VerifierPool  # noqa: E402
from hacrl_megatron.trainer import loop  # noqa: E402
from hacrl_megatron.trainer.colocation import ColocationSchedule  # noqa: E402
from tests.e2e.test_trainer import parity_reward, tiny_exp  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

RECORDED = {"sleep", "wake", "resume_memory", "release_memory", "generate", "sync_from", "sequence_logprob",
            "train_async", "token_logprobs", "sequence_logprobs"}


class Recorder:
    """``target`` with the calls named in :data:`RECORDED` appended to ``log`` as "agent.part.call(args)"."""

    def __init__(self, target, log: list[str], label: str) -> None:
        self._target, self._log, self._label = target, log, label

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if name not in RECORDED or not callable(value):
            return value

        def call(*args, **kwargs):
            shown = ",".join(str(a) for a in args if isinstance(a, (str, list, type(None)))) if name in (
                "sleep", "resume_memory") else ""
            self._log.append(f"{self._label}.{name}({shown})")
            return value(*args, **kwargs)

        return call


def colocated_run(tmp_path, backend: str, offload: str | None, log: list[str]):
    """The tiny run with its agents recorded and, unless ``offload`` is None, the colocated schedule."""
    run = loop.setup(tiny_exp(tmp_path, backend=backend))
    run.verifier.close()
    run.verifier = VerifierPool(num_workers=0, score_fn=parity_reward)
    for rt in run.runtimes:
        rt.trainer = Recorder(rt.trainer, log, f"{rt.name}.trainer")
        rt.engine = Recorder(rt.engine, log, f"{rt.name}.engine")
    run.colocation = ColocationSchedule(run.runtimes, colocated=offload is not None, offload=offload or "none")
    return run


def turns(log: list[str]) -> list[str]:
    """The log without the trainers' compute calls, one agent's name per phase ("*" when both did it)."""
    out: list[str] = []
    for entry in log:
        agent, call = entry.split(".", 1)
        if call.startswith(("trainer.train_async", "trainer.token_logprobs", "trainer.sequence_logprobs(")):
            continue
        other = f"{'qwen3' if agent == 'llama' else 'llama'}.{call}"
        if out and out[-1] == other and agent == "qwen3":
            out[-1] = f"*.{call}"
        else:
            out.append(f"{agent}.{call}")
    return out


SYNC = ["*.trainer.sleep(optimizer)", "*.engine.resume_memory(['weights'])", "*.engine.sync_from()",
        "*.trainer.sleep(all)", "*.engine.resume_memory()", "*.engine.sequence_logprob()"]
STEP = ["*.engine.generate()", "*.engine.release_memory()", "*.trainer.wake()"]


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_a_colocated_step_runs_the_documented_order_and_trains_as_without_colocation(tmp_path, backend):
    log: list[str] = []
    run = colocated_run(tmp_path / "colocated", backend, "all", log)
    plain = colocated_run(tmp_path / "plain", backend, None, [])
    try:
        colocated_steps = [loop.train_step(run) for _ in range(2)]
        plain_steps = [loop.train_step(plain) for _ in range(2)]
    finally:
        for rt in run.runtimes + plain.runtimes:
            rt.close()
    # step 1 starts from setup (both sides hold their memory): only the trainers go to sleep
    assert turns(log) == ["*.trainer.sleep(all)", *STEP, *SYNC, *STEP, *SYNC]
    # the trainers compute only between their wake and the sync's first sleep, and score the probe after the push
    for start in [i for i, e in enumerate(log) if e.endswith("trainer.wake()")]:
        until = next(i for i in range(start, len(log)) if log[i].endswith("sleep(optimizer)"))
        assert all("trainer." not in e or e.endswith(("wake()", "train_async()", "logprobs()")) for e in log[start:until])
    pushes = [i for i, e in enumerate(log) if e.endswith("sync_from()")]
    assert all(log[i + 1].endswith("trainer.sequence_logprobs()") for i in pushes)  # the trainer's half of the check
    assert run.colocation.turn == "generation"
    for colocated, unshared in zip(colocated_steps, plain_steps):
        for name in ("llama", "qwen3"):
            for key in ("hacpo/loss", "reward_mean", "hacpo/grad_norm", "sync_logp_diff"):
                assert colocated[f"{name}/{key}"] == unshared[f"{name}/{key}"], (name, key)
        assert colocated["llama/trainer/offload_mib"] > 0


def test_checkpoints_and_evaluations_take_their_turns(tmp_path):
    """A checkpoint needs the trainers awake (the engines release); the generation turn after it pushes
    the weights again, without a check; an evaluation is a generation turn."""
    log: list[str] = []
    run = colocated_run(tmp_path, "hf", "optimizer", log)
    try:
        loop.train_step(run)
        del log[:]
        loop._save(run)
        assert turns(log) == ["*.engine.release_memory()", "*.trainer.wake()"]
        del log[:]
        run.colocation.for_generation()
        assert turns(log) == ["*.trainer.sleep(optimizer)", "*.engine.resume_memory(['weights'])",
                              "*.engine.sync_from()", "*.trainer.sleep(optimizer)", "*.engine.resume_memory()"]  # offload=optimizer: no deeper
        del log[:]
        run.colocation.for_generation()
        assert log == []  # already the engines' turn
    finally:
        for rt in run.runtimes:
            rt.close()
