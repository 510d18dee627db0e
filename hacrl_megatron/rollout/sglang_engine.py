"""Rollout engine client for a running SGLang server (GPU), over its native HTTP API.

Standard library only (urllib + json), so it imports on any machine; torch is needed only for
``load_weights``. Endpoints used (sglang ``http_server.py`` / ``io_struct.py``, v0.4–0.5):

- ``GET  /health``                      200 when the server is up.
- ``POST /generate``                    ``{"input_ids": [[...], ...], "sampling_params": {...,"n": n}}``.
  The reply is a list of ``B·n`` dicts in prompt-major order (prompt i's samples at ``i·n .. i·n+n−1``,
  how the tokenizer manager fans out parallel sampling), each
  ``{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", "matched": id|str|None}, ...}}``.
- ``POST /update_weights_from_disk``    ``{"model_path": dir, "weight_version": v}`` — weights saved as
  safetensors in a folder the server can read (same node or shared filesystem).
- ``POST /update_weights_from_tensor``  ``{"serialized_named_tensors": [payload] * tp_size, "flush_cache": true}``,
  payload = base64 of ``ForkingPickler``-pickled ``[(name, tensor), ...]`` — SGLang's
  ``MultiprocessingSerializer`` format; for CUDA tensors this passes IPC handles, so it is only for a
  server colocated on the same GPUs (the "colocated" sync mode).

With ``server=`` (an :class:`~hacrl_megatron.rollout.sglang_server.SGLangServer` this process
started), a request that finds the server dead restarts it, reloads the last disk-synced weights
and is retried once.

Why no CPU test against a real server: SGLang's server needs ``sgl_kernel``, whose CPU build is not
on PyPI (see docs/measured.md §3); the unit test drives this client against a small fake
server on 127.0.0.1 that answers with the same JSON.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hacrl_megatron.rollout.types import Completion, SamplingParams

WEIGHT_SYNC_MODES = ("disk", "tensor")
# Files that make a weights folder loadable by SGLang besides the safetensors themselves.
_CONFIG_FILES = ("config.json", "generation_config.json")


class SGLangError(RuntimeError):
    """The SGLang server refused or failed a request; the message carries its reply."""


class SGLangUnreachable(SGLangError):
    """No connection to the server (refused, reset): it is down or still starting."""


class SGLangEngine:
    """A :class:`~hacrl_megatron.rollout.RolloutEngine` talking to one SGLang server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        eos_token_id: the model's eos id, to tell "eos" from other stops.
        tokenizer: optional; when given, ``Completion.text`` is decoded locally with it (special
            tokens skipped, spaces untouched — the exchange's convention) instead of the server text.
        weight_sync: "disk" (safetensors in ``sync_dir``) or "tensor" (colocated CUDA IPC).
        sync_dir: folder for "disk" updates; must be readable by the server.
        base_model_dir: the server's original model folder; its config files are copied next to
            the synced weights so that ``sync_dir`` is a complete checkpoint.
        tp_size: the server's tensor-parallel size ("tensor" mode sends one payload per rank).
        timeout: seconds per HTTP request.
        server: the :class:`~hacrl_megatron.rollout.sglang_server.SGLangServer` behind ``base_url``,
            if this process started it. Then a request that finds the server dead restarts it,
            reloads the last synced weights ("disk" mode: they are still in ``sync_dir``) and is
            retried once — a crashed rollout server costs a restart, not the run.
    """

    def __init__(self, base_url: str, *, eos_token_id: int, tokenizer: Any | None = None,
                 weight_sync: str = "disk", sync_dir: str | os.PathLike | None = None,
                 base_model_dir: str | os.PathLike | None = None, tp_size: int = 1,
                 timeout: float = 600.0, server: Any | None = None) -> None:
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"SGLangEngine: weight_sync={weight_sync!r} must be one of {list(WEIGHT_SYNC_MODES)}")
        if weight_sync == "disk" and sync_dir is None:
            raise ValueError("SGLangEngine: weight_sync='disk' needs sync_dir (a folder the server can read)")
        if tp_size < 1:
            raise ValueError(f"SGLangEngine: tp_size={tp_size} must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.eos_id = int(eos_token_id)
        self.tokenizer = tokenizer
        self.weight_sync = weight_sync
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.base_model_dir = Path(base_model_dir) if base_model_dir is not None else None
        self.tp_size = tp_size
        self.timeout = timeout
        self.server = server
        self.restarts = 0
        self.weight_version = 0
        self._tokens = 0
        self._seconds = 0.0
        self._sequences = 0

    # ----------------------------------------------------------------------------------------
    # HTTP

    def _request(self, path: str, payload: dict[str, Any] | None = None, method: str = "POST") -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise SGLangError(f"SGLang {method} {path} -> HTTP {e.code}: {detail}") from e
        except urllib.error.URLError as e:
            raise SGLangUnreachable(f"SGLang {method} {path}: cannot reach {self.base_url}: {e.reason}") from e
        except (ConnectionError, TimeoutError) as e:  # reset mid-reply, or no reply within timeout
            raise SGLangUnreachable(f"SGLang {method} {path}: {type(e).__name__}: {e}") from e
        return json.loads(body) if body else None

    def _request_with_recovery(self, path: str, payload: dict[str, Any], *, restore_weights: bool = True) -> Any:
        """``_request``; if the server we own has died, restart it, restore weights, retry once.

        ``restore_weights=False`` when the retried request itself pushes the weights.
        """
        try:
            return self._request(path, payload)
        except SGLangUnreachable:
            if self.server is None or (self.server.is_running() and self.server.healthy()):
                raise
        self._restart_server(restore_weights)
        return self._request(path, payload)

    def _restart_server(self, restore_weights: bool) -> None:
        self.server.restart()
        self.restarts += 1
        if not restore_weights or self.weight_version == 0:
            return  # the retried request pushes weights, or the server still has its initial ones
        if self.weight_sync != "disk":
            raise SGLangError("SGLang server restarted, but weights pushed as tensors cannot be restored; "
                              "push the trainer's weights again (load_weights) before generating")
        path = "/update_weights_from_disk"
        self._check_reply(path, self._request(path, {"model_path": str(self.sync_dir),
                                                     "weight_version": str(self.weight_version)}))

    def health(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            self._request("/health", method="GET")
        except SGLangError:
            return False
        return True

    def wait_until_healthy(self, timeout: float = 300.0, interval: float = 1.0) -> None:
        """Poll ``/health`` until it answers; raise :class:`SGLangError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise SGLangError(f"SGLang server {self.base_url} not healthy after {timeout:.0f} s")
            time.sleep(interval)

    # ----------------------------------------------------------------------------------------
    # generation

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "n": params.n,
            "temperature": float(params.temperature),  # SGLang treats 0 as greedy
            "top_p": float(params.top_p),
            "top_k": -1,
            "max_new_tokens": params.max_new_tokens,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,  # keep stop strings in the text, as the HF engine does
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.stop:
            sp["stop"] = list(params.stop)
        if params.seed is not None:
            sp["sampling_seed"] = int(params.seed)  # per-request seed (SGLang >= 0.5)
        return sp

    def _completion(self, item: dict[str, Any], params: SamplingParams) -> Completion:
        ids = [int(t) for t in item.get("output_ids", [])]
        finish = (item.get("meta_info") or {}).get("finish_reason") or {}
        kind, matched = finish.get("type"), finish.get("matched")
        if kind == "abort":
            raise SGLangError(f"SGLang aborted a request: {finish.get('message', finish)}")
        if kind == "length":
            reason = "length"
        elif kind == "stop":
            reason = "eos" if matched in (None, self.eos_id) else "stop"
            if isinstance(matched, int) and ids and ids[-1] == matched:
                ids = ids[:-1]  # the ending eos/stop id is reported by finish_reason, not token_ids
            elif ids and ids[-1] == self.eos_id:
                ids = ids[:-1]
        else:
            raise SGLangError(f"SGLang returned an unknown finish_reason {finish!r}")
        self._tokens += int((item.get("meta_info") or {}).get("completion_tokens", len(ids)))
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        else:
            text = item.get("text", "")
        return Completion(token_ids=tuple(ids), text=text, finish_reason=reason)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; ``out[i][j]`` is sample j of prompt i."""
        if not prompt_token_ids:
            return []
        for i, p in enumerate(prompt_token_ids):
            if len(p) == 0:
                raise ValueError(f"SGLangEngine.generate: prompt {i} is empty")
        payload = {"input_ids": [list(map(int, p)) for p in prompt_token_ids],
                   "sampling_params": self._sampling_params(params)}
        start = time.perf_counter()
        reply = self._request_with_recovery("/generate", payload)
        self._seconds += time.perf_counter() - start
        if isinstance(reply, dict):
            reply = [reply]
        expected = len(prompt_token_ids) * params.n
        if not isinstance(reply, list) or len(reply) != expected:
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise SGLangError(f"SGLang /generate returned {got} items, expected {expected} "
                              f"({len(prompt_token_ids)} prompts × n={params.n})")
        flat = [self._completion(item, params) for item in reply]
        self._sequences += expected
        return [flat[i * params.n: (i + 1) * params.n] for i in range(len(prompt_token_ids))]

    # ----------------------------------------------------------------------------------------
    # weights

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Push HF-named full tensors to the server; returns how many were sent."""
        tensors = [(name, t) for name, t in named_tensors]
        if not tensors:
            raise ValueError("SGLangEngine.load_weights: no tensors given")
        self.weight_version += 1
        if self.weight_sync == "disk":
            self._load_from_disk(tensors)
        else:
            self._load_from_tensor(tensors)
        return len(tensors)

    def _check_reply(self, path: str, reply: Any) -> None:
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangError(f"SGLang {path} failed: {reply.get('message', reply)}")

    def _load_from_disk(self, tensors: list[tuple[str, Any]]) -> None:
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ImportError("SGLang disk weight sync needs safetensors: pip install safetensors") from e
        assert self.sync_dir is not None
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        if self.base_model_dir is not None:
            for fname in _CONFIG_FILES:
                if (self.base_model_dir / fname).exists():
                    shutil.copy2(self.base_model_dir / fname, self.sync_dir / fname)
        state: dict[str, Any] = {}
        seen: set[int] = set()
        for name, t in tensors:
            t = t.detach().contiguous().cpu()
            if t.data_ptr() in seen:  # tied weights (lm_head = embed): safetensors refuses shared storage
                t = t.clone()
            seen.add(t.data_ptr())
            state[name] = t
        tmp = self.sync_dir / f".model.safetensors.tmp{os.getpid()}"
        save_file(state, str(tmp))
        os.replace(tmp, self.sync_dir / "model.safetensors")
        path = "/update_weights_from_disk"
        payload = {"model_path": str(self.sync_dir), "weight_version": str(self.weight_version)}
        self._check_reply(path, self._request_with_recovery(path, payload, restore_weights=False))

    def _load_from_tensor(self, tensors: list[tuple[str, Any]]) -> None:
        payload = serialize_named_tensors(tensors)
        path = "/update_weights_from_tensor"
        self._check_reply(path, self._request_with_recovery(path, {
            "serialized_named_tensors": [payload] * self.tp_size,
            "flush_cache": True,
            "weight_version": str(self.weight_version),
        }, restore_weights=False))

    def stats(self) -> dict[str, Any]:
        """tokens (completion tokens reported by the server), seconds, tokens_per_s, sequences, weight_version."""
        return {
            "tokens": self._tokens,
            "seconds": self._seconds,
            "tokens_per_s": self._tokens / self._seconds if self._seconds > 0 else 0.0,
            "sequences": self._sequences,
            "weight_version": self.weight_version,
            "restarts": self.restarts,
        }


def serialize_named_tensors(tensors: list[tuple[str, Any]]) -> str:
    """base64 of ``ForkingPickler``-pickled ``[(name, tensor)]`` (SGLang's MultiprocessingSerializer).

    Importing ``torch.multiprocessing`` registers torch's reducers, which pickle CUDA tensors as
    IPC handles (colocated server) and CPU tensors as shared-memory handles.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers tensor reducers with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, Any]]:
    """Inverse of :func:`serialize_named_tensors` (what the server does; used by the fake server)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    return ForkingPickler.loads(base64.b64decode(payload))
