"""Test-wide settings.

One intra-op thread per test process: on the 2-core CI machine a test that spawns workers (gloo
ranks, verifier processes) would otherwise run 2 threads per process and oversubscribe the cores;
OpenMP spin-waiting then makes tiny models 10-30× slower (measured: 38 s vs 1.2 s per step).
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
