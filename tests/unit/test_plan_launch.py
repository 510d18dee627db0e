"""``hacrl launch --executor slurm --dryrun`` of the multi-node 70B preset: the sbatch script, the
per-node Ray start-up and where every agent's ranks and engines go. Nothing is submitted."""

from __future__ import annotations

import glob
import os
import re
import sys

import pytest

pytest.importorskip("nemo_run")

from hacrl_megatron.config import load_config  # noqa: E402
from hacrl_megatron.launch import cli  # noqa: E402
from hacrl_megatron.launch.placement import PlacementError, node_plan  # noqa: E402

PRESET = "multinode_llama70b_qwen72b"
IMAGE = "nvcr.io/acme/hacrl:70b"


@pytest.fixture(autouse=True)
def readable_stdin(monkeypatch):
    """NeMo-Run's Slurm packaging reads stdin through invoke; pytest's captured stdin raises."""
    with open(os.devnull) as null:
        monkeypatch.setattr(sys, "stdin", null)
        yield


def dryrun(tmp_path, *extra: str, nodes: int = 9) -> tuple[str, str]:
    argv = ["--preset", PRESET, *extra, "--executor", "slurm", "--account", "acct", "--partition", "batch",
            "--nodes", str(nodes), "--gpus-per-node", "8", "--container-image", IMAGE, "--packager", "none",
            "--job-dir", str(tmp_path / "jobs"), "--base-dir", str(tmp_path / "exp"), "--dryrun", "--name", "h70",
            "--env", "NCCL_SOCKET_IFNAME=ib0"]
    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.main(p.parse_args(argv)) == 0
    (sbatch,) = glob.glob(str(tmp_path / "exp" / "experiments" / "h70" / "*" / "h70_sbatch.sh"))
    (script,) = glob.glob(str(tmp_path / "exp" / "experiments" / "h70" / "*" / "h70" / "scripts" / "*.sh"))
    return open(sbatch).read(), open(script).read()


def test_sbatch_and_ray_startup_for_all_nodes(tmp_path):
    sbatch, script = dryrun(tmp_path)
    for flag in ("--nodes=9", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive"):
        assert f"#SBATCH {flag}" in sbatch, flag
    assert f"--container-image {IMAGE}" in sbatch
    assert "export NCCL_SOCKET_IFNAME=ib0" in sbatch
    # every node runs the Ray script: the head (node 0) and 8 joining nodes, all awaited before training
    assert "start --head --block" in script and 'start --block --address="$RAY_ADDRESS"' in script
    assert 'slurm_ray wait --address "$RAY_ADDRESS" --nodes "$NNODES"' in script
    assert f"python -m hacrl_megatron train --preset {PRESET}" in script
    # engines are Ray actors: every node, the head included, offers all of its GPUs to Ray
    head = script[script.index("start --head"):script.index("RAY_PID=$!")]
    assert "--num-gpus" not in script and "CUDA_VISIBLE_DEVICES=" not in head
    assert "#SBATCH --mem=0" in sbatch and "#SBATCH --no-requeue" in sbatch
    # TP/SP overlap needs one CUDA work queue; NCCL defaults, overridable by the job's env
    for var, value in (("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("NCCL_DEBUG", "WARN"),
                       ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")):
        assert f'export {var}="${{{var}:-{value}}}"' in script, var


def test_placement_header_lists_every_agent_on_whole_nodes(tmp_path):
    _, script = dryrun(tmp_path)
    lines = [ln[len("# placement: "):] for ln in script.splitlines() if ln.startswith("# placement: ")]
    assert lines[0] == ("llama70b: 32 ranks (tp=4) on node 1 GPUs 0-7, node 2 GPUs 0-7, node 3 GPUs 0-7, "
                        "node 4 GPUs 0-7 (whole nodes); 1 engine(s) x 4 GPUs on node 0 GPUs 0-3")
    assert lines[1].startswith("qwen72b: 32 ranks (tp=4) on node 5 GPUs 0-7")
    assert lines[1].endswith("(whole nodes); 1 engine(s) x 4 GPUs on node 0 GPUs 4-7")
    assert lines[2] == "node 0: the controller (no GPU); Ray is offered all of its GPUs"


def test_tp8_agents_take_whole_nodes_and_tp_groups_stay_in_a_node(tmp_path):
    overrides = ["agents.0.parallel.tp=8", "agents.0.parallel.pp=4", "agents.1.parallel.tp=8",
                 "agents.1.parallel.pp=2", "agents.1.parallel.dp=2"]
    plan = node_plan(load_config(PRESET, overrides), 9, 8)
    assert plan.head_gpu_ids is None
    for agent, nodes in zip(plan.agents, [(1, 2, 3, 4), (5, 6, 7, 8)]):
        assert agent.nodes == nodes and agent.whole_nodes(8) and agent.tp_groups_within_nodes()
        assert sum(c for _, _, c in agent.spans) == agent.world == 32
    _, script = dryrun(tmp_path, *overrides)
    assert re.search(r"# placement: llama70b: 32 ranks \(tp=8\) on node 1 GPUs 0-7, .*node 4 GPUs 0-7 \(whole "
                     r"nodes\)", script)


def test_too_few_nodes_fail_before_anything_is_written(tmp_path, capsys):
    # 8 nodes: the trainers take all 64 GPUs from node 0 on, and node 0's engine GPUs are Llama's ranks
    with pytest.raises(PlacementError, match=r"agent 'llama70b': engine on node 0 GPUs \[0, 1, 2, 3\] overlaps "
                                             r"the trainer ranks of agent 'llama70b'"):
        node_plan(load_config(PRESET), 8, 8)
    with pytest.raises(PlacementError, match="need 64 GPUs, the job has 56 for them"):
        node_plan(load_config(PRESET), 7, 8)
    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--preset", PRESET, "--executor", "slurm", "--account", "a", "--nodes", "7",
                         "--gpus-per-node", "8", "--container-image", IMAGE, "--packager", "none", "--job-dir",
                         str(tmp_path / "j"), "--base-dir", str(tmp_path / "e"), "--dryrun"])
    assert cli.main(args) == 1
    assert "need 64 GPUs, the job has 56 for them (7 node(s) × 8)" in capsys.readouterr().err
    assert not glob.glob(str(tmp_path / "e" / "**" / "*_sbatch.sh"), recursive=True)


def test_shared_node_agents_are_reported_as_such():
    plan = node_plan(load_config("paper_qwen3_4b_with_instruct"), 1, 8)
    assert plan.head_gpu_ids is None and plan.shared  # the resident engines share the trainers' GPUs
    assert [a.spans for a in plan.agents] == [((0, 0, 4),), ((0, 4, 4),)]
    assert not plan.agents[0].whole_nodes(8) and plan.agents[0].tp_groups_within_nodes()


@pytest.mark.slow
def test_example_launch_script_plans_then_renders(tmp_path):
    """examples/multi_node_70b/launch.sh: hacrl plan's overrides go into hacrl launch unchanged."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ACCOUNT": "acct", "JOB_DIR": str(tmp_path / "jobs"),
           "PATH": bindir + os.pathsep + os.environ["PATH"]}
    out = subprocess.run(["bash", os.path.join(root, "examples", "multi_node_70b", "launch.sh"), "--dryrun",
                          "--base-dir", str(tmp_path / "exp"), "--packager", "none", "--container-image", IMAGE],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    (script,) = glob.glob(str(tmp_path / "exp" / "experiments" / PRESET / "*" / PRESET / "scripts" / "*.sh"))
    body = open(script).read()
    assert "agents.0.parallel.tp=4 agents.0.parallel.pp=8" in body and "rollout.weight_sync=distributed" in body
    assert "agents.0.model.hf_path=/models/Llama-3.1-70B-Instruct" in body and "--num-gpus" not in body
