"""Client of one running vLLM server (its OpenAI-compatible API server, GPU or CPU): generation with
per-sample seeds, scoring, health, memory hand-over and weight updates.

Standard library only (urllib + json), so it imports on any machine. :class:`VLLMEngine` is an
:class:`~hacrl_megatron.rollout.protocol.EngineClient`; only this module knows vLLM's routes. The
server is started by ``rollout/vllm_server.py`` with ``VLLM_SERVER_DEV_MODE=1`` (the routes below
marked *dev* exist only then). Endpoints used here:

- ``GET /health``: 200 when the server is up.
- ``POST /v1/completions`` with a token-id ``prompt``, ``return_token_ids: true``: **one request per
  sample**, ``n = 1`` and the sample's own ``seed`` (sent concurrently; the server batches them).
  Why not one request with ``n = G``: vLLM derives the seed of child j as ``seed + j``, so sample j of
  prompt i could not be drawn with the pool's ``seeds[i · n + j]`` (``rollout/protocol.py``), and a
  sample would depend on which request it was part of. A seeded request samples from its own
  generator, so the same seed reproduces the same sample. The reply's ``choices[0]``:
  ``{"token_ids": [...], "finish_reason": "stop"|"length"|"abort", "stop_reason": None|id|str}``;
  ``token_ids`` end with the eos (``stop_reason`` None) or stop id (``stop_reason`` that id) that
  ended the response, which :class:`~hacrl_megatron.rollout.types.Completion` leaves out. The eos is
  also sent as a stop id, so a response ends at the tokenizer's eos whatever the server read from
  the model folder (it is started with ``--generation-config vllm``: no sampling defaults and no
  extra eos ids from ``generation_config.json``, the HF engine's distribution).
- ``POST /v1/completions`` with ``prompt_logprobs: 0`` and ``max_tokens: 1``: the log-prob of every
  prompt token under the raw model (temperature 1; entry 0 is null), the weight-sync check's score of
  a sequence (:meth:`VLLMEngine.sequence_logprob`).
- weights from disk (*dev*): ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": folder}}`` (every worker reloads the safetensors of ``folder`` in place), then
  ``POST /reset_prefix_cache`` (cached prefixes were computed with the old weights) and
  ``POST /update_weight_version`` (what ``GET /weight_info`` reports).
- vLLM's weight-transfer engine (CUDA only; the server starts with ``--weight-transfer-config``):
  ``POST /init_weight_transfer_engine {"init_info": {...}}``, ``/start_weight_update``,
  ``/update_weights {"update_info": {...}}`` (one chunk), ``/finish_weight_update {"weight_version"}``,
  ``/shutdown_weight_transfer_engine`` — what ``sync/vllm_nccl.py`` (backend nccl, the
  ``distributed`` transport) and ``sync/vllm_ipc.py`` (backend ipc, ``tensor``) drive.
- ``POST /sleep?level=1`` / ``POST /wake_up?tags=...`` (*dev*): colocated servers (started with
  ``--enable-sleep-mode``) free their GPU memory while the trainer trains. On CPU both answer 200 and
  do nothing.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hacrl_megatron.rollout.protocol import EngineError, EngineUnreachable
from hacrl_megatron.rollout.servers import ServerLifecycle
from hacrl_megatron.rollout.types import Completion, SamplingParams, sample_seeds

COMPLETIONS = "/v1/completions"


def waited_for(path: str) -> str:
    """What a request on ``path`` waits for, in a timeout's message (the first ones after a start or a
    reload are the slow ones: the server compiles its graphs for the shapes it meets)."""
    if path.startswith(COMPLETIONS):
        return "a generation or a log-prob scoring (the first ones after a start or a weight reload compile)"
    if path == "/collective_rpc" or "weight" in path:
        return "the server to load new weights (its workers reload every tensor)"
    return "the server's answer"


class VLLMError(EngineError):
    """The vLLM server refused or failed a request; the message carries its reply."""


class VLLMUnreachable(VLLMError, EngineUnreachable):
    """No connection to the server (refused, reset): it is down or still starting."""


class VLLMEngine(ServerLifecycle):
    """A client of one vLLM server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        model: the served model name (the server's ``--model`` path unless ``--served-model-name``);
            None: the first model ``GET /v1/models`` lists, asked once.
        eos_token_id: the tokenizer's eos id: sent as a stop id and told apart from other stops.
        tokenizer: optional; when given, ``Completion.text`` is decoded locally with it (special
            tokens skipped, spaces untouched — the exchange's convention) instead of the server text.
        tp_size: the server's tensor-parallel size (the weight transports address each rank).
        timeout: seconds per HTTP request.
        server: the :class:`~hacrl_megatron.rollout.vllm_server.VLLMServer` behind ``base_url`` if this
            process started it (then :meth:`restart` works).
        name: label in metrics (``engine0``, ...).
        max_concurrency: sample requests in flight at once (the server batches them; more than its
            ``--max-num-seqs`` only queue there).
    """

    error, kind, health_timeout_s = VLLMError, "vLLM", 600.0  # ServerLifecycle (rollout/servers.py)

    runs_in_process = False  # the model runs in the server's processes (trainer/concurrency.py)

    def __init__(self, base_url: str, *, model: str | None = None, eos_token_id: int, tokenizer: Any | None = None,
                 tp_size: int = 1, timeout: float = 600.0, server: Any | None = None, name: str = "engine0",
                 max_concurrency: int = 64) -> None:
        if tp_size < 1:
            raise ValueError(f"VLLMEngine: tp_size={tp_size} must be >= 1")
        if max_concurrency < 1:
            raise ValueError(f"VLLMEngine: max_concurrency={max_concurrency} must be >= 1")
        self.base_url = base_url.rstrip("/")
        self._model = None if model is None else str(model)
        self.eos_id = int(eos_token_id)
        self.tokenizer = tokenizer
        self.tp_size = tp_size
        self.timeout = timeout
        self.server = server
        self.name = name
        self.max_concurrency = max_concurrency
        self.restarts = 0
        self.weight_version = 0  # the last version loaded through this client
        self._tokens = 0
        self._seconds = 0.0
        self._sequences = 0
        self._requests = 0

    # ----------------------------------------------------------------------------------------
    # HTTP

    def _request(self, path: str, payload: dict[str, Any] | None, method: str) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise VLLMError(f"vLLM {method} {self.base_url}{path} -> HTTP {e.code}: {detail}") from e
        except urllib.error.URLError as e:
            raise VLLMUnreachable(f"vLLM {method} {path}: cannot reach {self.base_url}: {e.reason}") from e
        except TimeoutError as e:  # the server took the request and did not answer in time
            raise VLLMUnreachable(f"vLLM {method} {self.base_url}{path}: no reply within {self.timeout:.0f} s "
                                  f"(the client's per-request timeout) while waiting for {waited_for(path)}") from e
        except ConnectionError as e:  # reset mid-reply
            raise VLLMUnreachable(f"vLLM {method} {self.base_url}{path}: {type(e).__name__}: {e}") from e
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """POST JSON to ``path``; the parsed reply."""
        return self._request(path, payload if payload is not None else {}, "POST")

    def get(self, path: str) -> Any:
        """GET ``path``; the parsed reply."""
        return self._request(path, None, "GET")

    @property
    def model(self) -> str:
        """The served model name every request names (asked of ``GET /v1/models`` when not given)."""
        if self._model is None:
            listed = (self.get("/v1/models") or {}).get("data") or []
            if not listed:
                raise VLLMError(f"vLLM {self.base_url}/v1/models lists no model")
            self._model = str(listed[0]["id"])
        return self._model

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory (level 1: weights offloaded to host memory, KV cache dropped).
        ``tags`` is accepted for the protocol; vLLM's sleep always frees both."""
        self.post("/sleep?level=1")

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory` freed: ``tags`` ("weights", "kv_cache"; None: both)."""
        query = "" if tags is None else "?" + urllib.parse.urlencode([("tags", t) for t in tags])
        self.post("/wake_up" + query)

    def close(self) -> None:
        """Stop the server this process started (nothing for a server started elsewhere); idempotent."""
        if self.server is not None:
            self.server.stop()

    def detached(self) -> VLLMEngine:
        """A client of the same server that pickles (no server handle, no tokenizer): the trainer's
        ranks send the weight-transfer requests with it."""
        return VLLMEngine(self.base_url, model=self._model, eos_token_id=self.eos_id, tp_size=self.tp_size,
                          timeout=self.timeout, name=self.name, max_concurrency=self.max_concurrency)

    # ----------------------------------------------------------------------------------------
    # weight updates (rollout/protocol.py: DiskWeightLoader, WeightTransferReceiver)

    def _set_version(self, version: int) -> None:
        self.post("/update_weight_version", {"new_version": str(version)})
        self.weight_version = int(version)

    def update_weights_from_disk(self, folder: str, version: int) -> None:
        """Every worker reloads its weights from the safetensors files in ``folder`` (in place, same
        names and shapes), then the prefix cache is dropped: its KV entries hold the old weights."""
        self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        self.post("/reset_prefix_cache")
        self._set_version(version)

    def server_weight_version(self) -> str:
        """The weight version the server reports (``GET /weight_info``; "default" before any update)."""
        return str(self.get("/weight_info")["weight_version"])

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Open vLLM's weight-transfer engine (the server's ``--weight-transfer-config`` backend) with
        ``init_info``; for NCCL it blocks until the group is complete."""
        self.post("/init_weight_transfer_engine", {"init_info": dict(init_info)})

    def start_weight_update(self) -> None:
        """Begin one update: the workers expect every weight before :meth:`finish_weight_update`."""
        self.post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one chunk (``update_info``: names, dtype_names, shapes and the backend's
        handles); returns after the workers loaded it."""
        self.post("/update_weights", {"update_info": dict(update_info)})

    def finish_weight_update(self, version: int) -> None:
        """Finish the update as weight version ``version`` and drop the prefix cache."""
        self.post("/finish_weight_update", {"weight_version": str(version)})
        self.post("/reset_prefix_cache")
        self.weight_version = int(version)

    def shutdown_weight_transfer(self) -> None:
        """Close the weight-transfer engine (its process group); the server keeps serving."""
        self.post("/shutdown_weight_transfer_engine")

    # ----------------------------------------------------------------------------------------
    # generation

    def _payload(self, prompt: list[int], params: SamplingParams, n: int, seed: int | None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in prompt],
            "n": n,
            "max_tokens": params.max_new_tokens,
            "temperature": float(params.temperature),  # vLLM treats 0 as greedy
            "top_p": 1.0 if params.greedy else float(params.top_p),
            "top_k": -1,  # softmax(logits / T) restricted by top_p only, what the trainer recomputes
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "stop_token_ids": [self.eos_id, *params.stop_token_ids],
            "return_token_ids": True,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,  # keep stop strings in the text, as the HF engine does
        }
        if params.stop:
            payload["stop"] = list(params.stop)
        if seed is not None:
            payload["seed"] = int(seed)
        return payload

    def _completion(self, choice: dict[str, Any], stop_ids: set[int]) -> Completion:
        ids = [int(t) for t in choice.get("token_ids") or []]
        kind, matched = choice.get("finish_reason"), choice.get("stop_reason")
        if kind == "length":
            reason = "length"
        elif kind == "stop":
            if isinstance(matched, str):
                reason = "stop"  # a stop string: its tokens are ordinary text and stay
            else:
                reason = "eos" if matched in (None, self.eos_id) else "stop"
                if ids and ids[-1] in stop_ids:
                    ids = ids[:-1]  # the ending eos/stop id is reported by finish_reason, not token_ids
        else:
            raise VLLMError(f"vLLM {self.base_url}: a request ended with finish_reason={kind!r} "
                            f"(stop_reason={matched!r})")
        self._tokens += len(choice.get("token_ids") or [])
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        else:
            text = choice.get("text", "")
        return Completion(token_ids=tuple(ids), text=text, finish_reason=reason)

    def _complete(self, payload: dict[str, Any], stop_ids: set[int]) -> list[Completion]:
        reply = self.post(COMPLETIONS, payload)
        choices = sorted((reply or {}).get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != payload["n"]:
            raise VLLMError(f"vLLM {COMPLETIONS} returned {len(choices)} choices, expected n={payload['n']}")
        return [self._completion(c, stop_ids) for c in choices]

    def generate_seeded(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                        seeds: list[int] | None) -> list[list[Completion]]:
        """``params.n`` completions per prompt, sample j of prompt i drawn with ``seeds[i · n + j]``
        (``len(prompts) · n`` of them, prompt-major) in a request of its own; None: greedy decoding,
        one request per prompt whose one completion stands for all n (vLLM refuses n > 1 when greedy)."""
        n = params.n
        for i, p in enumerate(prompt_token_ids):
            if len(p) == 0:
                raise ValueError(f"VLLMEngine.generate: prompt {i} is empty")
        if seeds is not None and len(seeds) != len(prompt_token_ids) * n:
            raise ValueError(f"VLLMEngine.generate: {len(seeds)} seeds for {len(prompt_token_ids)} prompts × n={n}")
        if not prompt_token_ids:
            return []
        if seeds is None:
            payloads = [self._payload(p, params, 1, None) for p in prompt_token_ids]
        else:
            payloads = [self._payload(p, params, 1, seeds[i * n + j])
                        for i, p in enumerate(prompt_token_ids) for j in range(n)]
        stop_ids = {self.eos_id, *params.stop_token_ids}
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(len(payloads), self.max_concurrency),
                                thread_name_prefix=f"{self.name}-requests") as pool:
            replies = list(pool.map(lambda pl: self._complete(pl, stop_ids), payloads))
        self._seconds += time.perf_counter() - start
        self._requests += len(payloads)
        if seeds is None:
            replies = [group * n for group in replies]
        flat = [c for group in replies for c in group]
        self._sequences += len(flat)
        return [flat[i * n: (i + 1) * n] for i in range(len(prompt_token_ids))]

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; ``out[i][j]`` is sample j of prompt i."""
        seeds = None if params.greedy else sample_seeds(params.seed, len(prompt_token_ids) * params.n)
        return self.generate_seeded(prompt_token_ids, params, seeds)

    def sequence_logprob(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Σ log π(response | prompt) under the server's current weights (nats, temperature 1)."""
        if not prompt_ids:
            raise ValueError("VLLMEngine.sequence_logprob: prompt_ids is empty")
        if not response_ids:
            return 0.0
        ids = [int(t) for t in list(prompt_ids) + list(response_ids)]
        reply = self.post(COMPLETIONS, {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                        "prompt_logprobs": 0})
        entries = ((reply or {}).get("choices") or [{}])[0].get("prompt_logprobs") or []
        if len(entries) != len(ids):
            raise VLLMError(f"vLLM {COMPLETIONS} returned {len(entries)} prompt_logprobs for {len(ids)} tokens; "
                            "cannot score the probe sequence")
        total = 0.0
        for pos in range(len(prompt_ids), len(ids)):
            entry = entries[pos] or {}
            if str(ids[pos]) not in entry:
                raise VLLMError(f"vLLM prompt_logprobs at position {pos} do not hold token {ids[pos]} "
                                f"(got {sorted(entry)}); cannot score the probe sequence")
            total += float(entry[str(ids[pos])]["logprob"])
        return total

    def stats(self) -> dict[str, Any]:
        """tokens (generated, incl. the eos/stop token that ended a response), seconds (wall time of
        generate calls), tokens_per_s, sequences, requests, restarts."""
        return {
            "tokens": self._tokens,
            "seconds": self._seconds,
            "tokens_per_s": self._tokens / self._seconds if self._seconds > 0 else 0.0,
            "sequences": self._sequences,
            "requests": self._requests,
            "restarts": self.restarts,
        }
