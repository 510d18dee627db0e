"""Disk weight sync: safetensors shards in a folder every engine can read, then each engine's
``update_weights_from_disk`` (:class:`~hacrl_megatron.rollout.protocol.DiskWeightLoader`: an SGLang
server, an in-process HF engine).

Works across nodes with a shared filesystem and survives a server restart (the last folder is
reloaded by :meth:`DiskTransport.restore`). Cost: every step writes and reads the whole model
(a 70B bf16 agent: ~141 GB), which the distributed transport avoids.

Each version goes to its own folder ``sync_dir/v<version>`` (written under a temporary name, then
renamed), so a crash mid-write never leaves a half-written folder where a restarted server would
read it; the previous folder is removed once every engine has loaded the new one.

A model with tied embeddings (``tie_word_embeddings`` in the base folder's config) gets ``lm_head.weight``
written beside ``model.embed_tokens.weight`` when the stream has only the embedding (a Megatron export
sends the shared tensor once): vLLM 0.32's in-place reload leaves a tied LM head on its old values unless
the folder holds it (measured: 0.4 nats off on a 9-token probe after one training step).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from hacrl_megatron.rollout.protocol import DiskWeightLoader
from hacrl_megatron.sync.base import NamedTensors, on_all, tensor_bytes

# Files that make a weights folder a complete checkpoint (what a server loads) besides the safetensors.
CONFIG_FILES = ("config.json", "generation_config.json")
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # HF names of a tied pair


class DiskTransport:
    """Args:
        sync_dir: parent folder of the version folders; must be readable by every server.
        base_model_dir: the servers' original model folder; its config files are copied into
            each version folder so that it is a complete checkpoint.
        shard_bytes: bytes of tensors held in memory and written per safetensors file.
    """

    name = "disk"
    engine_protocol = DiskWeightLoader

    def __init__(self, sync_dir: str | os.PathLike, base_model_dir: str | os.PathLike | None = None,
                 shard_bytes: int = 2 << 30) -> None:
        if shard_bytes < 1:
            raise ValueError(f"DiskTransport: shard_bytes={shard_bytes} must be >= 1")
        self.sync_dir = Path(sync_dir)
        self.base_model_dir = None if base_model_dir is None else Path(base_model_dir)
        self.shard_bytes = shard_bytes
        self.current: Path | None = None
        self.tied = self._tied_embeddings()

    def _tied_embeddings(self) -> bool:
        config = None if self.base_model_dir is None else self.base_model_dir / "config.json"
        if config is None or not config.is_file():
            return False
        return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))

    def folder(self, version: int) -> Path:
        return self.sync_dir / f"v{version}"

    def write(self, named_tensors: NamedTensors, version: int) -> tuple[Path, int]:
        """Write version ``version``'s folder; returns (folder, number of tensors)."""
        from safetensors.torch import save_file

        final = self.folder(version)
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.base_model_dir is not None:
            for fname in CONFIG_FILES:
                if (self.base_model_dir / fname).exists():
                    shutil.copy2(self.base_model_dir / fname, tmp / fname)
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        size, count, total = 0, 0, 0
        embedding: torch.Tensor | None = None

        def flush() -> None:
            nonlocal shard, size
            fname = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            shard, size = {}, 0

        for name, tensor in named_tensors:
            t = tensor.detach().contiguous().cpu()
            if any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in shard.values()):
                t = t.clone()  # tied weights (lm_head = embed): safetensors refuses shared storage
            shard[name] = t
            if name == EMBEDDING and self.tied:
                embedding = t
            size, count, total = size + tensor_bytes(t), count + 1, total + tensor_bytes(t)
            if size >= self.shard_bytes:
                flush()
        if embedding is not None and LM_HEAD not in weight_map and LM_HEAD not in shard:
            shard[LM_HEAD] = embedding.clone()  # the tied head as its own tensor (module docstring)
            total += tensor_bytes(embedding)
        if shard:
            flush()
        if count == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError("DiskTransport.write: no tensors given")
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final, count

    def push(self, engines: Sequence[DiskWeightLoader], named_tensors: NamedTensors, version: int) -> int:
        folder, count = self.write(named_tensors, version)
        on_all(engines, lambda e: e.update_weights_from_disk(str(folder), version))
        previous, self.current = self.current, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)
        return count

    def restore(self, engine: DiskWeightLoader, version: int) -> bool:
        if self.current is None:
            return True  # never synced: the restarted server's initial weights are current
        engine.update_weights_from_disk(str(self.current), version)
        return True

    def close(self) -> None:
        """Nothing to release: the last folder stays (a restarted run can inspect it)."""
