"""``hacrl prepare``: put the paper's datasets and models where the presets read them.

- :func:`prepare_dataset` (``hacrl prepare data NAME...``): a public hub dataset → ``<out>/<name>/<split>.jsonl``
  in the layout ``data/benchmarks.py`` reads (:mod:`.data`);
- :func:`prepare_model` (``hacrl prepare model HUB_ID``): an HF model snapshot → ``<out>/<model name>``,
  optionally converted to a Megatron checkpoint at a chosen TP/PP (:mod:`.model`).

Both download from the Hugging Face hub (``$HF_ENDPOINT``) or read a local folder in the hub's
layout (``--mirror DIR``: ``DIR/<repo id>/...``), never at training time. Without a network they stop
with one line naming the endpoint and exit status 2 (:mod:`.hub`).
"""

from hacrl_megatron.prepare.data import DATASETS, prepare_dataset
from hacrl_megatron.prepare.hub import HubError
from hacrl_megatron.prepare.model import prepare_model

__all__ = ["DATASETS", "HubError", "prepare_dataset", "prepare_model"]
