"""examples/slurm_paper_settings: launch.sh renders the three paper settings' Slurm jobs in dry run
(NeMo-Run writes the sbatch script and the Ray-cluster script, submits nothing); the scripts
carry the container, mounts, resources and the training command with the mounted model paths."""

from __future__ import annotations

import glob
import os
import re

import pytest

from hacrl_megatron import __version__
from hacrl_megatron.config import load_config
from tests.examples.helpers import ROOT, readme_commands, run

pytest.importorskip("nemo_run")
pytestmark = pytest.mark.slow  # three `hacrl launch` processes, ~15 s each of imports

SETTINGS = {  # preset -> the HF folder names launch.sh mounts for agents 0 and 1
    "paper_qwen3_4b_with_instruct": ("Qwen3-4B", "Qwen3-4B-Instruct-2507"),
    "paper_qwen3_1p7b_with_4b_base": ("Qwen3-1.7B-Base", "Qwen3-4B-Base"),
    "paper_qwen3_4b_base_with_llama3p2_3b": ("Qwen3-4B-Base", "Llama-3.2-3B-Instruct"),
}


def test_slurm_paper_settings_dry_run(tmp_path, monkeypatch):
    (dry,) = [c for c in readme_commands("slurm_paper_settings") if "--dryrun" in c]
    base = tmp_path / "nemo_run"
    monkeypatch.delenv("HACRL_IMAGE", raising=False)  # the default image
    # from the checkout: NeMo-Run's git packager ships the repository the command runs in; a dry
    # run writes only under --base-dir and JOB_DIR
    env = {"JOB_DIR": str(tmp_path / "jobs"), "NODES": "2", "HACRL_CACHE": str(tmp_path / "cache")}
    out = run(dry, ROOT, "--base-dir", str(base), env=env, timeout=600)
    for preset, models in SETTINGS.items():
        assert f"hacrl launch: {preset} DRYRUN" in out.stdout
        (sbatch,) = glob.glob(str(base / "experiments" / preset / "*" / f"{preset}_sbatch.sh"))
        text = open(sbatch).read()
        for flag in ("--account=my_account", "--partition=batch", "--nodes=2", "--gpus-per-node=8",
                     "--time=24:00:00", "--ntasks-per-node=1"):
            assert f"#SBATCH {flag}" in text, (preset, flag)
        assert f"--container-image hacrl-megatron:{__version__}" in text
        assert "--container-mounts /shared/hacrl/models:/models,/shared/hacrl/data:/data,/shared/hacrl/runs:/runs" in text
        assert "export HACRL_DATA_DIR=/data" in text and "export HF_HUB_OFFLINE=1" in text
        (script,) = glob.glob(str(base / "experiments" / preset / "*" / preset / "scripts" / f"{preset}.sh"))
        body = open(script).read()
        assert "start --head --block" in body and 'start --block --address="$RAY_ADDRESS"' in body
        (command,) = re.findall(r"python -m hacrl_megatron train .*", body)
        assert command.split()[3:6] == ["train", "--preset", preset]
        overrides = command.split()[6:]
        m0, m1 = (f"/models/{m}" for m in models)
        assert overrides == [f"output_dir=/runs/{preset}", "data.path=/data/math/train.jsonl",
                             f"agents.0.model.hf_path={m0}", f"agents.0.tokenizer={m0}",
                             f"agents.1.model.hf_path={m1}", f"agents.1.tokenizer={m1}"]
        cfg = load_config(preset, overrides)  # the job's config resolves and validates
        assert [os.path.basename(load_config(preset).agents[i].model.hf_path) for i in (0, 1)] == list(models)
        assert (cfg.agents[0].parallel.tp, cfg.agents[0].parallel.dp, cfg.rollout.engine) == (2, 2, "sglang")
