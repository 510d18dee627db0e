"""NeMo-Run recipe objects: executors and tasks carry the right fields; the Slurm dry run writes an
sbatch script with one Ray node per task and the hacrl command on the head. No job is submitted
(no Slurm or Docker here); the local end-to-end runs are in test_launch_local.py."""

from __future__ import annotations

import argparse
import glob
import os
import sys

import pytest

run = pytest.importorskip("nemo_run")

from hacrl_megatron.launch import cli  # noqa: E402
from hacrl_megatron.launch.executors import (  # noqa: E402
    SlurmJob,
    docker_executor,
    local_executor,
    require_nemo_run,
    slurm_executor,
)
from hacrl_megatron.launch.recipes import build_task, hacrl_command, launch_train  # noqa: E402
from hacrl_megatron.launch.slurm_ray import ray_cluster_script  # noqa: E402

# every executor's jobs start Megatron ranks with one CUDA work queue (or what this shell exported)
RANK_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}

PRESET = "paper_qwen3_4b_with_instruct"


@pytest.fixture(autouse=True)
def readable_stdin(monkeypatch):
    """NeMo-Run's Slurm packaging runs shell commands through invoke, which reads stdin; pytest's
    captured stdin raises on read, a real launch has a terminal or a pipe there."""
    with open(os.devnull) as null:
        monkeypatch.setattr(sys, "stdin", null)
        yield


def _slurm(tmp_path, packager="none", **kw):
    job = dict(time="01:00:00", job_dir=str(tmp_path / "jobs"), container_mounts=["/data:/data"])
    job.update(kw)
    return slurm_executor(SlurmJob("acct", "batch", 2, 8, "nvcr.io/hacrl:1", **job),
                          env_vars={"HF_HOME": "/data/hf"}, packager=packager)


def test_slurm_executor_fields(tmp_path):
    ex = _slurm(tmp_path)
    assert isinstance(ex, run.SlurmExecutor)
    assert (ex.account, ex.partition, ex.nodes, ex.ntasks_per_node, ex.gpus_per_node) == ("acct", "batch", 2, 1, 8)
    assert ex.container_image == "nvcr.io/hacrl:1" and ex.container_mounts == ["/data:/data"]
    assert ex.time == "01:00:00" and ex.exclusive is True
    assert ex.env_vars == {"PYTHONUNBUFFERED": "1", **RANK_ENV, "HF_HOME": "/data/hf"}
    assert isinstance(ex.tunnel, run.LocalTunnel) and ex.tunnel.job_dir == str(tmp_path / "jobs")
    assert type(ex.packager) is run.Packager
    assert isinstance(_slurm(tmp_path, packager="git").packager, run.GitArchivePackager)
    cpu = slurm_executor(SlurmJob("acct"))
    assert cpu.gpus_per_node is None and cpu.container_image is None


def test_slurm_executor_over_ssh_and_bad_values(tmp_path):
    ex = _slurm(tmp_path, ssh_host="login.cluster", ssh_user="me")
    assert isinstance(ex.tunnel, run.SSHTunnel)
    assert (ex.tunnel.host, ex.tunnel.user, ex.tunnel.job_dir) == ("login.cluster", "me", str(tmp_path / "jobs"))
    with pytest.raises(ValueError, match="ssh_host='login.cluster' needs ssh_user and job_dir"):
        SlurmJob("acct", "batch", 1, 8, ssh_host="login.cluster")
    with pytest.raises(ValueError, match="nodes=0: must be >= 1"):
        SlurmJob("acct", "batch", 0, 8)
    with pytest.raises(ValueError, match="gpus_per_node=-1: must be >= 0"):
        SlurmJob("acct", gpus_per_node=-1)
    with pytest.raises(ValueError, match="packager='zip'"):
        _slurm(tmp_path, packager="zip")


def test_slurm_dryrun_writes_sbatch_and_ray_cluster_script(tmp_path):
    result = launch_train(PRESET, ["train.steps=3", "data.path=/data/my set.jsonl"], _slurm(tmp_path), "hacpo4b",
                          base_dir=str(tmp_path / "exp"), dryrun=True, port=6380, wait_timeout_s=900)
    assert result.ok and result.state == "DRYRUN"
    (sbatch,) = glob.glob(str(tmp_path / "exp" / "experiments" / "hacpo4b" / "*" / "hacpo4b_sbatch.sh"))
    text = open(sbatch).read()
    for flag in ("--account=acct", "--partition=batch", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8",
                 "--time=01:00:00", "--exclusive"):
        assert f"#SBATCH {flag}" in text, flag
    assert "--container-image nvcr.io/hacrl:1" in text and "/data:/data" in text
    assert "export HF_HOME=/data/hf" in text
    (script,) = glob.glob(str(tmp_path / "exp" / "experiments" / "hacpo4b" / "*" / "hacpo4b" / "scripts" / "*.sh"))
    body = open(script).read()
    assert f"python -m hacrl_megatron train --preset {PRESET} train.steps=3 'data.path=/data/my set.jsonl'" in body
    assert "PORT=6380" in body and "TIMEOUT=900" in body
    assert "start --head --block" in body and 'start --block --address="$RAY_ADDRESS"' in body
    assert "ray stop" not in body.replace("`ray stop` would", "")  # never the node-wide kill


def test_docker_executor_fields():
    ex = docker_executor("hacrl:latest", volumes=["/ckpt:/ckpt"], env_vars={"A": "1"}, packager="none")
    assert isinstance(ex, run.DockerExecutor)
    assert (ex.container_image, ex.num_gpus, ex.runtime, ex.ipc_mode, ex.shm_size) == \
        ("hacrl:latest", -1, "nvidia", "host", "16g")
    assert ex.volumes == ["/ckpt:/ckpt"] and ex.env_vars == {"PYTHONUNBUFFERED": "1", **RANK_ENV, "A": "1"}
    # a job's own value wins over the Megatron rank default
    assert docker_executor("h:1", env_vars={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}).env_vars[
        "CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    cpu = docker_executor("hacrl:cpu", num_gpus=0)
    assert cpu.num_gpus is None and cpu.runtime is None


def test_tasks_are_python_modules_or_the_ray_script():
    local = local_executor(env_vars={"X": "1"})
    # the checkout first on PYTHONPATH: `python -m hacrl_megatron` works without installing the package
    root = local.env_vars["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(root, "hacrl_megatron", "cli.py")) and local.env_vars["X"] == "1"
    assert local.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == RANK_ENV["CUDA_DEVICE_MAX_CONNECTIONS"]
    task = build_task("cpu_demo", ["train.steps=1"], local)
    # run.Script's default entrypoint is bash, which cannot run a python module (docs/measured.md §4)
    assert (task.entrypoint, task.m, task.path, task.args) == \
        (sys.executable, True, "hacrl_megatron", ["train", "--preset", "cpu_demo", "train.steps=1"])
    wrapped = build_task("cpu_demo", [], local, ray_cluster=True)
    assert wrapped.entrypoint == "bash" and "start --head --block" in wrapped.inline


def test_hacrl_command_and_script_reject_bad_input():
    assert hacrl_command("config", None, ["a.b=1"]) == ["python", "-m", "hacrl_megatron", "config", "a.b=1"]
    with pytest.raises(ValueError, match="subcommand='serve'"):
        hacrl_command("serve", None, [])
    with pytest.raises(ValueError, match="override 'train.steps': expected dotted.key=value"):
        hacrl_command("train", None, ["train.steps"])
    with pytest.raises(ValueError, match="port=0"):
        ray_cluster_script(["true"], port=0)
    with pytest.raises(ValueError, match="command must not be empty"):
        ray_cluster_script([])


def test_missing_nemo_run_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_run", None)
    with pytest.raises(ImportError, match=r"leptonai==0.27.3"):
        require_nemo_run()


def _args(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_cli_validates_before_submitting(tmp_path, capsys):
    from hacrl_megatron.config import ConfigError

    with pytest.raises(ConfigError, match="hacpo.alpha=-1.0"):
        cli.main(_args(["hacpo.alpha=-1", "--dryrun"]))
    assert cli.main(_args(["--executor", "slurm", "--dryrun"])) == 2
    assert "--executor slurm needs --account" in capsys.readouterr().err
    assert cli.main(_args(["--executor", "docker", "--container-image", "none"])) == 2
    assert "needs a container image" in capsys.readouterr().err
    argv = ["--executor", "slurm", "--account", "acct", "--nodes", "2", "--gpus-per-node", "4", "--packager", "none",
            "--job-dir", str(tmp_path / "jobs"), "--base-dir", str(tmp_path / "exp"), "--dryrun", "--name", "c",
            "--env", "A=1", "train.steps=2"]
    assert cli.main(_args(argv)) == 0
    assert "c DRYRUN" in capsys.readouterr().out
    (script,) = glob.glob(str(tmp_path / "exp" / "experiments" / "c" / "*" / "c" / "scripts" / "*.sh"))
    assert "python -m hacrl_megatron train --preset cpu_demo train.steps=2" in open(script).read()


def _archive_names(path):
    import tarfile

    with tarfile.open(path) as tar:
        return sorted(m.name.removeprefix("./") for m in tar.getmembers() if m.isfile())


@pytest.mark.parametrize("folder", ["plain_folder", "a folder with spaces"])
def test_git_packager_ships_the_committed_tree_from_a_path_with_a_space(tmp_path, folder):
    import subprocess

    repo = tmp_path / folder / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "README.md").write_text("r\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    (repo / "uncommitted.txt").write_text("not shipped\n")
    packager = _slurm(tmp_path, packager="git").packager
    job_dir = tmp_path / folder / "job dir"
    job_dir.mkdir()
    out = packager.package(repo, str(job_dir), "job")
    assert out == str(job_dir / "job.tar.gz") and _archive_names(out) == ["README.md", "pkg/a.py"]
    assert packager.package(repo, str(job_dir), "job") == out  # an existing archive is reused, as NeMo-Run does


def test_git_packager_refuses_what_it_cannot_ship_from_a_quoted_path_naming_it(tmp_path):
    import subprocess

    repo = tmp_path / "with space" / "repo"
    repo.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    packager = _slurm(tmp_path, packager="git").packager
    packager.include_pattern = ["extra/*"]
    packager.include_pattern_relative_path = [""]
    with pytest.raises(RuntimeError, match=r"the checkout '.*with space/repo'.*--packager none"):
        packager.package(repo, str(tmp_path / "with space"), "job")
    with pytest.raises(RuntimeError, match=r"git rev-parse --show-toplevel` in '.*not a repo' failed"):
        _slurm(tmp_path, packager="git").packager.package(tmp_path / "not a repo", str(tmp_path), "job")
