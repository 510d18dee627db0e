"""Client of one running SGLang server (GPU, or CPU: ``rollout.sglang.cpu``), over its native HTTP API: generation, scoring, health,
memory hand-over and weight updates.

Standard library only (urllib + json), so it imports on any machine. :class:`SGLangEngine` is an
:class:`~hacrl_megatron.rollout.protocol.EngineClient` and offers every weight-update operation of
``rollout/protocol.py``: the transports of ``sync/`` (disk, tensor, distributed) call those methods,
and only this module knows SGLang's routes. Several engines of one agent are driven together by
:class:`~hacrl_megatron.rollout.engine_pool.EnginePool`. Endpoints used here:

- ``GET  /health``: 200 when the server is up.
- ``POST /generate``: ``{"input_ids": [[...], ...], "sampling_params": [{...}, ...]}``, **one entry
  per sample**: prompt i's G samples are G entries with ``n = 1`` and seeds ``sample_seeds(...)``.
  Why not one entry with ``n = G``: with ``--enable-deterministic-inference`` SGLang samples with
  ``multinomial_with_seed(seed, position)``, so the G copies of one request (same seed, same
  positions) come back identical — every group advantage is then 0. A request without a seed gets
  seed 42 on such a server, so the client always sends distinct seeds. Without deterministic
  inference the server ignores ``sampling_seed`` and samples from its own generator. The reply is
  one dict per entry, in order: ``{"text", "output_ids", "meta_info": {"finish_reason": {"type":
  "stop"|"length"|"abort", "matched": id|str|None}, "completion_tokens", ...}}``.
- ``POST /generate`` with ``return_logprob`` and ``logprob_start_len``: the log-probs of a given
  sequence (:meth:`SGLangEngine.sequence_logprob`, the weight-sync check). SGLang reports input
  log-probs of the raw model (temperature 1).
- ``POST /release_memory_occupation`` / ``/resume_memory_occupation``: colocated engines free the
  GPU while the trainer trains (the server needs ``--enable-memory-saver``).
- weight updates: ``POST /update_weights_from_disk`` (a safetensors folder), ``/update_weights_from_tensor``
  (CUDA IPC handles, one serialized copy per TP rank), ``/init_weights_update_group``,
  ``/update_weights_from_distributed`` (one flattened bucket per request, ``load_format:
  "flattened_bucket"``) and ``/destroy_weights_update_group``; every one carries ``weight_version``
  where SGLang takes it.

The request fields are checked against SGLang's own request classes by the CPU tests: the
stand-in server (``tests/fixtures/fake_sglang_server.py``) validates every payload against the
fields extracted from released wheels (``tools/sglang_contract.py``), because a real server drops
unknown keys silently. The same tests run against the real server on CPU (0.5.23 with the recipe of
``tests/fixtures/sglang_cpu/``: ``tests/conformance/``, ``.ci/sglang.sh test``).

Tensor and distributed pushes run inside the server's weight-update session (0.5.21 and later):
``POST /begin_weight_update`` ... ``POST /end_weight_update``, opened by the transports through
:meth:`SGLangEngine.begin_weight_update` / :meth:`SGLangEngine.end_weight_update`, which read the
server's release once from ``GET /server_info`` (older releases: no session). Replies the client
handles as the real server sends them: ``/flush_cache`` plain text, memory release/resume ``null``,
``input_token_logprobs[0]`` null at ``logprob_start_len``, the weight version in ``/model_info``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from hacrl_megatron.rollout.protocol import EngineError, EngineUnreachable
from hacrl_megatron.rollout.server_secrets import redact
from hacrl_megatron.rollout.servers import ServerLifecycle
from hacrl_megatron.rollout.types import Completion, SamplingParams, sample_seeds

# SGLang's name for the bucket layout of update_weights_from_distributed (sync/weight_group.flatten_bucket)
FLATTENED_BUCKET = "flattened_bucket"
# the first release whose scheduler refuses tensor/distributed pushes outside POST /begin_weight_update ...
# POST /end_weight_update (0.5.20 has neither route; 0.5.21's weight updater checks the session)
WEIGHT_SESSION_SINCE = (0, 5, 21)
# an update whose weights were loaded but whose prefix-cache flush found a request still finishing (SGLang
# answers the update with HTTP 400 and this text; the cache is then flushed by POST /flush_cache, retried)
UNFLUSHED = "the cache was not flushed"
FLUSH_WAIT_S = 60.0


def reported_as(reported: Any, sent: int) -> bool:
    """Whether an id in SGLang's ``input_token_logprobs`` stands for the ``sent`` token: the same id, or 0,
    which SGLang reports for the vocabulary's last id (``vocab_size - 1`` and above: its image-token
    clipping, ``logprob_result_processor``); the log-prob beside it is the sent token's."""
    return reported is not None and (int(reported) == int(sent) or int(reported) == 0)


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` → (0, 5, 23); ``"0.5.15.post1"`` and ``"0.5.22rc1"`` → their first three numbers.
    Raises ValueError for text without a leading number."""
    parts = []
    for piece in version.strip().split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"not a release number: {version!r}")
    return tuple(parts)


class SGLangError(EngineError):
    """The SGLang server refused or failed a request; the message carries its reply."""


class SGLangUnreachable(SGLangError, EngineUnreachable):
    """No connection to the server (refused, reset): it is down or still starting."""


class SGLangEngine(ServerLifecycle):
    """A client of one SGLang server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        eos_token_id: the model's eos id, to tell "eos" from other stops.
        tokenizer: optional; when given, ``Completion.text`` is decoded locally with it (special
            tokens skipped, spaces untouched — the exchange's convention) instead of the server text.
        tp_size: the server's tensor-parallel size (weight transports address each TP rank).
        timeout: seconds per HTTP request.
        server: the :class:`~hacrl_megatron.rollout.sglang_server.SGLangServer` behind ``base_url``
            if this process started it (then :meth:`restart` works).
        name: label in metrics (``engine0``, ...).
    """

    error, kind, health_timeout_s = SGLangError, "SGLang", 300.0  # ServerLifecycle (rollout/servers.py)

    runs_in_process = False  # the model runs in the server's processes (trainer/concurrency.py)

    def __init__(self, base_url: str, *, eos_token_id: int, tokenizer: Any | None = None, tp_size: int = 1,
                 timeout: float = 600.0, server: Any | None = None, name: str = "engine0",
                 api_key: str | None = None) -> None:
        if tp_size < 1:
            raise ValueError(f"SGLangEngine: tp_size={tp_size} must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.eos_id = int(eos_token_id)
        self.tokenizer = tokenizer
        self.tp_size = tp_size
        self.timeout = timeout
        self.server = server
        self.name = name
        self.api_key = api_key or None  # sent as "Authorization: Bearer <key>" (SGLang's --api-key)
        self.restarts = 0
        self._server_version: str | None = None  # read once (/server_info), kept by detached copies
        self._tokens = 0
        self._seconds = 0.0
        self._sequences = 0
        self._requests = 0

    # ----------------------------------------------------------------------------------------
    # HTTP

    def _request(self, path: str, payload: dict[str, Any] | None, method: str) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = redact(e.read().decode(errors="replace")[:2000], self.api_key)  # never echo the key
            raise SGLangError(f"SGLang {method} {self.base_url}{path} -> HTTP {e.code}: {detail}") from e
        except urllib.error.URLError as e:
            raise SGLangUnreachable(f"SGLang {method} {path}: cannot reach {self.base_url}: {e.reason}") from e
        except (ConnectionError, TimeoutError) as e:  # reset mid-reply, or no reply within timeout
            raise SGLangUnreachable(f"SGLang {method} {self.base_url}{path}: {type(e).__name__}: {e}") from e
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:  # a route that answers text (/flush_cache)
            return body.decode(errors="replace")

    def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """POST JSON to ``path``; the parsed reply. A reply ``{"success": false}`` raises SGLangError."""
        reply = self._request(path, payload if payload is not None else {}, "POST")
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangError(f"SGLang {self.base_url}{path} failed: {reply.get('message', reply)}")
        return reply

    def flush_cache(self, wait_s: float = 0.0) -> None:
        """Empty the server's prefix cache (``POST /flush_cache``; SGLang answers plain text). The server
        refuses while a request is running or queued: retried for up to ``wait_s`` seconds."""
        deadline, pause = time.monotonic() + wait_s, 0.05
        while True:
            try:
                self.post("/flush_cache", None)
                return
            except SGLangUnreachable:
                raise
            except SGLangError:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def _post_update(self, path: str, payload: dict[str, Any]) -> None:
        """POST a weight update. SGLang fails an update whose weights loaded but whose cache flush met a
        request still finishing (:data:`UNFLUSHED`): the weights are in, so the flush is redone here."""
        try:
            self.post(path, payload)
        except SGLangUnreachable:
            raise
        except SGLangError as e:
            if UNFLUSHED not in str(e):
                raise
            self.flush_cache(wait_s=FLUSH_WAIT_S)

    def server_weight_version(self) -> str:
        """The weight version the server reports (``/model_info``'s "weight_version": the
        ``weight_version`` of the last update, SGLang's "default" before any)."""
        info = self._request("/model_info", None, "GET")
        version = info.get("weight_version") if isinstance(info, dict) else None
        if version is None:
            raise SGLangError(f"SGLang {self.name} ({self.base_url}): /model_info has no \"weight_version\"")
        return str(version)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory (``tags``: "weights", "kv_cache"; None: both)."""
        self.post("/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` freed."""
        self.post("/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def restart(self) -> None:
        """Restart the server this process started; its release is read again afterwards."""
        self._server_version = None
        super().restart()

    def close(self) -> None:
        """Stop the server this process started (nothing for a server started elsewhere); idempotent."""
        if self.server is not None:
            self.server.stop()

    def detached(self) -> SGLangEngine:
        """A client of the same server that pickles (no server handle, no tokenizer): the trainer's
        ranks send the distributed transport's requests with it."""
        copy = SGLangEngine(self.base_url, eos_token_id=self.eos_id, tp_size=self.tp_size, timeout=self.timeout,
                            name=self.name, api_key=self.api_key)
        copy._server_version = self._server_version
        return copy

    # ----------------------------------------------------------------------------------------
    # the weight-update session (SGLang >= 0.5.21; rollout/protocol.py: WeightUpdateSession)

    def server_version(self) -> str:
        """The server's SGLang release, read once from ``GET /server_info`` ("version"; releases
        before ``/server_info`` have ``/get_server_info``)."""
        if self._server_version is None:
            try:
                info = self._request("/server_info", None, "GET")
            except SGLangError as e:
                if "HTTP 404" not in str(e):
                    raise
                info = self._request("/get_server_info", None, "GET")
            version = info.get("version") if isinstance(info, dict) else None
            if not isinstance(version, str) or not version:
                raise SGLangError(f"SGLang {self.name} ({self.base_url}): /server_info has no \"version\"; "
                                  "cannot tell whether pushes need a weight-update session")
            self._server_version = version
        return self._server_version

    def has_weight_session(self) -> bool:
        """Whether the server takes tensor/distributed pushes only between begin and end
        (:data:`WEIGHT_SESSION_SINCE`)."""
        return release_tuple(self.server_version()) >= WEIGHT_SESSION_SINCE

    def begin_weight_update(self) -> None:
        """``POST /begin_weight_update {}`` (servers without the session: nothing). A session a
        failed trainer left open is closed first: this client is the server's only writer."""
        if not self.has_weight_session():
            return
        try:
            self.post("/begin_weight_update", {})
        except SGLangUnreachable:
            raise
        except SGLangError as e:
            if "already open" not in str(e):
                raise
            self.post("/end_weight_update", {})
            self.post("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        """``POST /end_weight_update {}``: the server finalises the pushed weights."""
        if self.has_weight_session():
            self.post("/end_weight_update", {})

    # ----------------------------------------------------------------------------------------
    # weight updates (rollout/protocol.py: DiskWeightLoader, TensorWeightLoader, BroadcastWeightLoader)

    def update_weights_from_disk(self, folder: str, version: int) -> None:
        """The server reloads its weights from the safetensors files in ``folder``."""
        self._post_update("/update_weights_from_disk", {"model_path": str(folder), "weight_version": str(version)})

    def update_weights_from_tensor(self, serialized: list[str], *, flush_cache: bool, version: int) -> None:
        """One bucket of IPC handles, ``serialized[k]`` for TP rank k (each unpickling consumes its handles)."""
        if len(serialized) != self.tp_size:
            raise ValueError(f"SGLangEngine {self.name}: {len(serialized)} serialized copies for tp_size={self.tp_size}")
        self._post_update("/update_weights_from_tensor", {"serialized_named_tensors": list(serialized),
                                                  "flush_cache": bool(flush_cache), "weight_version": str(version)})

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        """The server's TP ranks join the group (SGLang's rendezvous); blocks until it is complete."""
        self.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, version: int) -> None:
        """Receive one flattened bucket broadcast from group rank 0 and load it."""
        self._post_update("/update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "load_format": FLATTENED_BUCKET, "flush_cache": bool(flush_cache),
            "weight_version": str(version)})

    def destroy_weights_update_group(self, group_name: str) -> None:
        """The server's ranks leave the group."""
        self.post("/destroy_weights_update_group", {"group_name": group_name})

    # ----------------------------------------------------------------------------------------
    # generation

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "n": 1,
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
        return sp

    def _completion(self, item: dict[str, Any]) -> Completion:
        ids = [int(t) for t in item.get("output_ids", [])]
        meta = item.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
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
        self._tokens += int(meta.get("completion_tokens", len(ids)))
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        else:
            text = item.get("text", "")
        return Completion(token_ids=tuple(ids), text=text, finish_reason=reason)

    def generate_seeded(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                        seeds: list[int] | None) -> list[list[Completion]]:
        """:meth:`generate` with explicit per-entry seeds (``len(prompts) · n`` of them, prompt-major;
        None for greedy decoding). The pool uses it so that a sample's seed does not depend on
        which engine draws it."""
        n = params.n
        for i, p in enumerate(prompt_token_ids):
            if len(p) == 0:
                raise ValueError(f"SGLangEngine.generate: prompt {i} is empty")
        if seeds is not None and len(seeds) != len(prompt_token_ids) * n:
            raise ValueError(f"SGLangEngine.generate: {len(seeds)} seeds for {len(prompt_token_ids)} prompts × n={n}")
        if not prompt_token_ids:
            return []
        base = self._sampling_params(params)
        entries = [dict(base) for _ in range(len(prompt_token_ids) * n)]
        for entry, seed in zip(entries, seeds or ()):
            entry["sampling_seed"] = int(seed)
        payload = {"input_ids": [list(map(int, p)) for p in prompt_token_ids for _ in range(n)],
                   "sampling_params": entries}
        start = time.perf_counter()
        reply = self.post("/generate", payload)
        self._seconds += time.perf_counter() - start
        self._requests += 1
        if isinstance(reply, dict):
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != len(entries):
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise SGLangError(f"SGLang /generate returned {got} items, expected {len(entries)} "
                              f"({len(prompt_token_ids)} prompts × n={n})")
        flat = [self._completion(item) for item in reply]
        self._sequences += len(flat)
        return [flat[i * n: (i + 1) * n] for i in range(len(prompt_token_ids))]

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; ``out[i][j]`` is sample j of prompt i."""
        seeds = None if params.greedy else sample_seeds(params.seed, len(prompt_token_ids) * params.n)
        return self.generate_seeded(prompt_token_ids, params, seeds)

    def sequence_logprob(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Σ log π(response | prompt) under the server's current weights (nats, temperature 1)."""
        if not prompt_ids:
            raise ValueError("SGLangEngine.sequence_logprob: prompt_ids is empty")
        if not response_ids:
            return 0.0
        ids = [int(t) for t in list(prompt_ids) + list(response_ids)]
        reply = self.post("/generate", {
            "input_ids": ids, "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        if isinstance(reply, list):
            reply = reply[0]
        entries = (reply.get("meta_info") or {}).get("input_token_logprobs") or []
        tail = entries[-len(response_ids):]
        if len(tail) != len(response_ids) or not all(reported_as(e[1], t) for e, t in zip(tail, response_ids)):
            raise SGLangError(f"SGLang /generate input_token_logprobs do not line up with the {len(response_ids)} "
                              f"response tokens (got {len(entries)} entries for logprob_start_len="
                              f"{len(prompt_ids) - 1}: ids {[e[1] for e in entries]}, sent {ids}); cannot score "
                              "the probe sequence")
        return float(sum(float(e[0]) for e in tail))

    def stats(self) -> dict[str, Any]:
        """tokens (completion tokens reported by the server), seconds, tokens_per_s, sequences,
        requests, restarts."""
        return {
            "tokens": self._tokens,
            "seconds": self._seconds,
            "tokens_per_s": self._tokens / self._seconds if self._seconds > 0 else 0.0,
            "sequences": self._sequences,
            "requests": self._requests,
            "restarts": self.restarts,
        }
