"""`hacrl launch`: the Docker and Slurm executors default to the image the top-level Dockerfile
builds (hacrl-megatron:<package version>, or $HACRL_IMAGE); nothing is submitted here."""

from __future__ import annotations

import argparse
import glob
import os
import sys

import pytest

run = pytest.importorskip("nemo_run")

import hacrl_megatron  # noqa: E402
from hacrl_megatron.launch import cli  # noqa: E402


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(cli.IMAGE_ENV, raising=False)
    with open(os.devnull) as null:  # NeMo-Run's Slurm packaging reads stdin (see test_launch_recipes.py)
        monkeypatch.setattr(sys, "stdin", null)
        yield


def _args(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


SLURM = ["--executor", "slurm", "--account", "acct", "--packager", "none"]


def test_default_image_is_the_dockerfile_tag(monkeypatch):
    assert cli.default_image() == f"hacrl-megatron:{hacrl_megatron.__version__}"
    monkeypatch.setenv(cli.IMAGE_ENV, "registry.example.com/hacrl/hacrl-megatron:7")
    assert cli.default_image() == "registry.example.com/hacrl/hacrl-megatron:7"


def test_docker_executor_defaults_and_overrides(monkeypatch):
    ex = cli.build_executor(_args(["--executor", "docker"]))
    assert isinstance(ex, run.DockerExecutor)
    assert ex.container_image == f"hacrl-megatron:{hacrl_megatron.__version__}"
    monkeypatch.setenv(cli.IMAGE_ENV, "site/hacrl:env")
    assert cli.build_executor(_args(["--executor", "docker"])).container_image == "site/hacrl:env"
    ex = cli.build_executor(_args(["--executor", "docker", "--container-image", "site/hacrl:flag"]))
    assert ex.container_image == "site/hacrl:flag"  # the flag wins over the environment
    with pytest.raises(ValueError, match="needs a container image"):
        cli.build_executor(_args(["--executor", "docker", "--container-image", "none"]))


def test_slurm_executor_defaults_to_the_image_and_none_means_bare_metal(monkeypatch, tmp_path):
    ex = cli.build_executor(_args(SLURM + ["--job-dir", str(tmp_path)]))
    assert isinstance(ex, run.SlurmExecutor)
    assert ex.container_image == f"hacrl-megatron:{hacrl_megatron.__version__}"
    monkeypatch.setenv(cli.IMAGE_ENV, "registry#hacrl/hacrl-megatron:0.1.0")
    assert cli.build_executor(_args(SLURM + ["--job-dir", str(tmp_path)])).container_image == \
        "registry#hacrl/hacrl-megatron:0.1.0"
    bare = cli.build_executor(_args(SLURM + ["--job-dir", str(tmp_path), "--container-image", "none"]))
    assert bare.container_image is None


def test_slurm_dryrun_script_runs_in_the_default_image(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(cli.IMAGE_ENV, "registry.example.com#hacrl/hacrl-megatron:0.1.0")
    argv = SLURM + ["--job-dir", str(tmp_path / "jobs"), "--base-dir", str(tmp_path / "exp"), "--dryrun",
                    "--name", "img", "train.steps=2"]
    assert cli.main(_args(argv)) == 0
    (sbatch,) = glob.glob(str(tmp_path / "exp" / "experiments" / "img" / "*" / "img_sbatch.sh"))
    srun = [line for line in open(sbatch) if line.startswith("srun ")]
    assert len(srun) == 1 and "--container-image registry.example.com#hacrl/hacrl-megatron:0.1.0 " in srun[0]
