"""`hacrl train --agent` under hostile input and faults (docs/exchange.md): forged, damaged and foreign records
are refused naming their author, a wrong setup is one line with exit 2, and a peer killed with -9 resumes
and rejoins while the other job trains on alone (exchange.on_missing=alone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hacrl_megatron.exchange.remote.shared_dir import SharedDirStore
from hacrl_megatron.exchange.remote.signing import sign
from tests.unit.test_peer_exchange_record import make_record

BASE = ["log.tensorboard=false", "log.progress=false", "train.eval_every=0", "train.verifier_workers=0",
        "log.samples_every=0"]


def hacrl_train(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hacrl_megatron", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def shared(tmp_path: Path, *extra: str) -> list[str]:
    return ["exchange.backend=shared_dir", f"exchange.dir={tmp_path / 'ex'}", *extra]


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


KEY = b"9f3c1a7e5b2d8064c1e9a3f7b5d20861"  # 32 bytes of 16 distinct values: a real key, not a pattern


def key_file(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def test_forged_damaged_and_unsigned_records_are_refused_naming_their_author(tmp_path):
    key = key_file(tmp_path / "exchange.key", KEY)
    folder = tmp_path / "ex" / "cpu_demo"
    folder.mkdir(parents=True)
    store = SharedDirStore(tmp_path / "ex", "cpu_demo")  # no key: writes unsigned records, as an intruder would
    store.publish(make_record(step=0, agent="qwen3", run_id="cpu_demo"))  # unsigned
    forged = make_record(step=1, agent="qwen3", run_id="cpu_demo").to_dict()
    forged["hmac_sha256"] = sign(forged, b"another-key-of-32-bytes-xxxxxxxxx")  # signed with another key
    (folder / "step-00000001.qwen3.json").write_text(json.dumps(forged))
    (folder / "step-00000002.qwen3.json").write_text('{"format": "hacrl-exchange/2", "run_id": "cpu_d')  # truncated
    done = hacrl_train(["--agent", "llama", *BASE, "train.steps=3", f"output_dir={tmp_path / 'llama'}",
                        *shared(tmp_path, f"exchange.key_file={key}", "exchange.wait_s=1",
                                "exchange.on_missing=alone")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    where = tmp_path / "ex" / "cpu_demo"
    assert (f"exchange record of agent 'qwen3' refused ({where / 'step-00000000.qwen3.json'}): field 'hmac_sha256': "
            "missing, but the exchange is configured with a key") in done.stderr
    assert (f"exchange record of agent 'qwen3' refused ({where / 'step-00000001.qwen3.json'}): field 'hmac_sha256': "
            "does not match the record (forged, altered, or signed with another key)") in done.stderr
    assert (f"exchange record of agent 'qwen3' refused ({where / 'step-00000002.qwen3.json'}): field 'record': "
            "not valid JSON") in done.stderr
    trained = rows(tmp_path / "llama")
    assert [r["llama/exchange/peers_missing"] for r in trained] == [1.0, 1.0, 1.0]  # each step trained alone
    assert all("llama/omega/qwen3" in r for r in trained)
    # this job's own records are signed with the key: a reader with the key accepts them
    with SharedDirStore(tmp_path / "ex", "cpu_demo", key=KEY) as reader:
        assert reader.read(2, "llama").agent == "llama"


@pytest.mark.parametrize("setting, differs", [
    ("data.checker", "a checker that returns 1.0 for every response"),
    ("data.path (file content)", "another data file whose ids coincide"),
    ("train.verifier_mode", "math_verify instead of math"),
])
def test_a_record_of_another_configuration_stops_the_job_naming_the_setting(tmp_path, setting, differs):
    """The peer (qwen3) joined the run first and published step 0 with one setting that decides the
    reward or the data changed: the llama job stops at its first step naming that setting."""
    from hacrl_megatron.config import load_config
    from hacrl_megatron.trainer.run_identity import digest_of, shared_config_fields

    fields = shared_config_fields(load_config("cpu_demo", BASE))
    assert setting in fields
    fields[setting] = "0" * 16  # the peer's value of the setting: ``differs``
    store = SharedDirStore(tmp_path / "ex", "cpu_demo")
    store.join_run("qwen3", fresh=True)
    store.publish(make_record(step=0, agent="qwen3", run_id="cpu_demo", weights_version=0, run_nonce=store.run_nonce,
                              config_digest=digest_of(fields), config_fields=fields))
    done = hacrl_train(["--agent", "llama", *BASE, "train.steps=2", f"output_dir={tmp_path / 'llama'}",
                        *shared(tmp_path, "exchange.wait_s=30")], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hacrl: exchange record of agent 'qwen3' refused (step 0): field 'config_digest': "
                           f"'{digest_of(fields)}', this job's is 'sha256:"), last
    assert f"the jobs run different configurations; they differ on {setting} (its setting's digest '0000" in last


@pytest.mark.parametrize("args, message", [
    (["--agent", "mistral"], "hacrl: --agent 'mistral': no such agent in this config; its agents are ['llama', 'qwen3']"),
    (["--agent", "llama"], "hacrl: --agent runs one agent of the run in this process; its peers run as other jobs, "
                           "which the local exchange cannot reach: set exchange.backend=shared_dir"),
    (["--agent", "llama", "exchange.backend=shared_dir"],
     "hacrl: configuration error: exchange.dir=None: required when exchange.backend=shared_dir"),
    (["--agent", "llama", "exchange.backend=redis", "exchange.redis_url=redis://:pw@127.0.0.1:1/0"],
     "hacrl: exchange.redis_url: carries a password; put it in a file"),
    (["--agent", "llama", "exchange.backend=shared_dir", "exchange.dir=ex", "rollout.eos_mode=source_eos_text"],
     "hacrl: --agent with rollout.eos_mode=source_eos_text: that rule encodes each peer's eos string"),
])
def test_a_wrong_setup_is_one_line_and_exit_2(tmp_path, args, message):
    done = hacrl_train([*args, *BASE, "train.steps=1", f"output_dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr[-2000:]


def test_an_unreachable_redis_server_is_refused_before_any_model_is_built(tmp_path):
    pytest.importorskip("redis")
    from tests.fixtures.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    done = hacrl_train(["--agent", "llama", *BASE, "exchange.backend=redis", f"exchange.redis_url={url}",
                        f"output_dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"hacrl: exchange redis server {url}: PING failed: "
                                                           "ConnectionError")
    assert not (tmp_path / "run").exists()  # refused before the run folder, warm-up or model


def test_a_fresh_job_refuses_an_exchange_holding_its_records_of_an_earlier_run(tmp_path):
    SharedDirStore(tmp_path / "ex", "cpu_demo").publish(make_record(step=3, agent="llama", run_id="cpu_demo"))
    done = hacrl_train(["--agent", "llama", *BASE, "train.steps=1", f"output_dir={tmp_path / 'llama'}",
                        *shared(tmp_path)], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"hacrl: exchange run 'cpu_demo' (exchange.dir {tmp_path / 'ex'}) already holds agent 'llama''s records of "
        "steps 3..3 from an earlier run: set another exchange.run_id, delete those records, or continue that run "
        "with checkpoint.resume=true")


def wait_for_rows(folder: Path, count: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = folder / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{folder}: fewer than {count} metrics rows after {timeout} s")


@pytest.mark.slow
def test_a_peer_killed_mid_run_resumes_and_rejoins_while_the_other_trains_alone(tmp_path):
    steps = 14
    common = [*BASE, f"train.steps={steps}", "checkpoint.every=2", "exchange.keep_steps=20",
              *shared(tmp_path, "exchange.wait_s=4", "exchange.on_missing=alone")]

    def start(agent: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", "--agent", agent, *common,
                                 f"output_dir={tmp_path / agent}", *extra], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    llama, qwen3 = start("llama"), start("qwen3")
    wait_for_rows(tmp_path / "qwen3", 3, qwen3)
    os.killpg(qwen3.pid, signal.SIGKILL)  # the peer's whole job, mid-run
    qwen3.wait(timeout=30)
    killed_at = len(rows(tmp_path / "qwen3"))
    resumed = start("qwen3", "checkpoint.resume=true")
    for proc in (llama, resumed):
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
    alone = [r["llama/exchange/peers_missing"] for r in rows(tmp_path / "llama")]
    assert len(alone) == steps and alone[:killed_at - 1] == [0.0] * (killed_at - 1)
    first_missing = alone.index(1.0)  # llama went on alone while qwen3 was down ...
    assert 0.0 in alone[first_missing:], alone  # ... and qwen3, resumed from its checkpoint, rejoined
    back = rows(tmp_path / "qwen3")
    assert back[-1]["step"] == steps
    # the resumed job re-read llama's records of the steps it redid (kept: exchange.keep_steps=20)
    assert all(r["qwen3/exchange/peers_missing"] == 0.0 for r in back[:steps - 1]), back


@pytest.mark.slow
def test_a_second_job_of_the_same_agent_takes_it_over_and_the_first_stops(tmp_path):
    """Two jobs train agent llama in one exchange (e.g. a restart elsewhere while the first still runs): the
    later one claims the agent and the earlier one stops at its next publish (exit 2, naming both), so the
    agent's records have one author."""
    common = [*BASE, "train.steps=30", *shared(tmp_path, "exchange.wait_s=0.2", "exchange.on_missing=alone")]
    first = subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", "--agent", "llama", *common,
                              f"output_dir={tmp_path / 'first'}"], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    wait_for_rows(tmp_path / "first", 2, first)
    # checkpoint.resume=true: the second job may start where records of its agent exist (the fresh-run check)
    second = hacrl_train(["--agent", "llama", *BASE, "train.steps=2", f"output_dir={tmp_path / 'second'}",
                          "checkpoint.resume=true", *shared(tmp_path, "exchange.wait_s=0.2",
                                                            "exchange.on_missing=alone")], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"hacrl: exchange run 'cpu_demo' (exchange.dir {tmp_path / 'ex'}): agent 'llama' was "
                           "claimed by another job ("), last
    assert "this job stops so that one job only trains and publishes the agent" in last


@pytest.mark.slow
def test_an_exchange_folder_lost_mid_run_stops_the_job_with_one_line_and_it_resumes(tmp_path):
    """The shared folder disappears under a running job (an unmounted filesystem): exit 1, one line naming the
    folder and the last checkpoint; with the folder back, the job resumes from that checkpoint."""
    import shutil

    common = [*BASE, "train.steps=30", "checkpoint.every=2", f"output_dir={tmp_path / 'llama'}",
              *shared(tmp_path, "exchange.wait_s=0.2", "exchange.on_missing=alone")]
    job = subprocess.Popen([sys.executable, "-m", "hacrl_megatron", "train", "--agent", "llama", *common],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_rows(tmp_path / "llama", 3, job)
    run_folder = tmp_path / "ex" / "cpu_demo"
    shutil.rmtree(run_folder)
    run_folder.write_text("not a folder")
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"hacrl: exchange folder {run_folder}: "), last  # reading its claim or writing a record
    assert "failed: Not a directory; last checkpoint: " in last and "checkpoint.resume=true" in last
    run_folder.unlink()
    done = hacrl_train(["--agent", "llama", *common[:-2], "train.steps=5", "checkpoint.resume=true",
                        *shared(tmp_path, "exchange.wait_s=0.2", "exchange.on_missing=alone")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert rows(tmp_path / "llama")[-1]["step"] == 5
