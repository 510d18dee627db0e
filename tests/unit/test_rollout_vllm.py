"""``rollout.engine: vllm`` without a vLLM server: the ``rollout.vllm`` section and its rules, the server's
command line and environment, the client's requests and its reading of replies (against a stand-in
HTTP server that answers like vLLM 0.32's, as measured against the real one in
tests/e2e/test_rollout_vllm.py), the pool and the transports it takes, and the wire format of the
vLLM weight-transfer transports (their GPU halves: tests/gpu/test_rollout_vllm_gpu.py)."""

from __future__ import annotations

import base64
import json
import math
import pickle
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hacrl_megatron.config import VLLM_PYTHON_ENV, ConfigError, VLLMConfig, load_config
from hacrl_megatron.rollout import EnginePool, HFEngine, SamplingParams, sample_seeds
from hacrl_megatron.rollout.vllm_engine import VLLMEngine, VLLMError, VLLMUnreachable
from hacrl_megatron.rollout.vllm_server import (
    VLLMServer,
    check_cpu_head_size,
    gpu_groups,
    server_env,
    server_flags,
    vllm_python,
)
from hacrl_megatron.sync import make_transport
from hacrl_megatron.sync.disk import DiskTransport
from hacrl_megatron.sync.tensor import TensorTransport
from hacrl_megatron.sync.vllm_ipc import VLLMIPCTransport, bucket_update_info
from hacrl_megatron.sync.vllm_nccl import VLLMNCCLTransport, chunk_update_info, flat_bytes, packed_chunks

EOS = 0


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)


def fake_python(tmp_path, mode=0o755):
    path = tmp_path / "venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


# --------------------------------------------------------------------------------------------
# configuration


def test_interpreter_resolution_and_checks(no_env, monkeypatch, tmp_path):
    assert vllm_python("") == sys.executable
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/from/env/python")
    assert vllm_python("") == "/from/env/python" and vllm_python("/cfg/python") == "/cfg/python"
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.python \(from \$HACRL_VLLM_PYTHON\)='/from/env/python': "
                                          "must be an existing file"):
        load_config("cpu_demo", ["rollout.engine=vllm"])
    monkeypatch.delenv(VLLM_PYTHON_ENV)
    py = fake_python(tmp_path)
    assert load_config("cpu_demo", ["rollout.engine=vllm", f"rollout.vllm.python={py}"]).rollout.vllm.python == str(py)
    py.chmod(0o644)
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.python='.*': must be executable"):
        load_config("cpu_demo", ["rollout.engine=vllm", f"rollout.vllm.python={py}"])
    absent = tmp_path / "absent"  # not checked unless the engine is vllm
    assert load_config("cpu_demo", [f"rollout.vllm.python={absent}"]).rollout.vllm.python == str(absent)
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.python=.*unused when rollout\.vllm\.command is set"):
        load_config("cpu_demo", ["rollout.engine=vllm", f"rollout.vllm.python={absent}",
                                 "rollout.vllm.command=[srun,python]"])


def test_an_interpreter_under_a_path_with_a_space_is_warned_about_by_its_whole_path(tmp_path, caplog):
    """vLLM on CPU cannot score from an environment under a path with a space (docs/engines.md): the server
    says so when it is made, with the field and the whole path; a plain path or a full command says nothing."""
    spaced = str(tmp_path / "a venv with spaces" / "bin" / "python")
    with caplog.at_level("WARNING", logger="hacrl_megatron.rollout.vllm_server"):
        VLLMServer(tmp_path / "model", python=spaced, log_path=tmp_path / "s.log")
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert f"rollout.vllm.python {spaced!r} has a space in its path" in message and "symlink" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="hacrl_megatron.rollout.vllm_server"):
        VLLMServer(tmp_path / "model", python="/opt/venv/bin/python", log_path=tmp_path / "s.log")
        VLLMServer(tmp_path / "model", python=spaced, command=["srun", "python"], log_path=tmp_path / "s.log")
    assert caplog.records == []


@pytest.mark.parametrize("overrides, message", [
    (["rollout.weight_sync=inprocess"], r"rollout\.weight_sync='inprocess': rollout\.engine=vllm takes weights by "
                                        r"\['auto', 'disk', 'tensor', 'distributed'\]"),
    (["rollout.weight_sync=tensor", "rollout.colocate=true", "rollout.vllm.tp=2"],
     r"rollout\.vllm\.tp=2: rollout\.weight_sync=tensor \(CUDA IPC\) reaches the trainer's one GPU"),
    (["rollout.vllm.max_model_len=40"], r"rollout\.vllm\.max_model_len=40: must hold rollout\.max_prompt_len \+ "
                                        r"rollout\.max_response_len = 48 tokens"),
    (["rollout.vllm.dtype=fp8"], r"rollout\.vllm\.dtype='fp8': must be one of \['auto', 'float32', 'bfloat16'"),
    (["rollout.vllm.gpu_memory_utilization=1.0"], r"rollout\.vllm\.gpu_memory_utilization=1\.0: "),
    (["rollout.vllm.tp=2", "agents.0.rollout_gpu_ids=[0,1,2]"],
     r"agents\.0\.rollout_gpu_ids=\[0, 1, 2\]: needs one GPU per vLLM TP rank: a multiple of rollout\.vllm\.tp=2"),
])
def test_rules_name_the_field(no_env, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu_demo", ["rollout.engine=vllm", *overrides])


def test_defaults_auto_sync_and_colocation(no_env):
    r = load_config("cpu_demo", ["rollout.engine=vllm"]).rollout
    assert r.engine_settings is r.vllm and r.vllm == VLLMConfig()
    assert r.vllm.auto_weight_sync(colocate=False) == r.vllm.auto_weight_sync(colocate=True) == "disk"
    assert load_config("cpu_demo", ["rollout.engine=vllm", "rollout.colocate=true"]).rollout.colocate
    assert load_config("cpu_demo", ["rollout.engine=vllm", "rollout.vllm.tp=2",
                                    "agents.0.rollout_gpu_ids=[0,1,2,3]"]).agents[0].rollout_gpu_ids == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------------
# the server's command line


def test_flags_and_environment_follow_the_transport():
    v = VLLMConfig(max_model_len=256, max_num_seqs=8, args=["--seed", "3"], cpu_kv_cache_gib=2)
    base = server_flags(v, colocate=False, weight_sync="disk")
    assert base == ["--dtype", "float32", "--generation-config", "vllm", "--gpu-memory-utilization", "0.7",
                    "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--seed", "3"]
    nccl = server_flags(v, colocate=False, weight_sync="distributed")
    assert nccl[nccl.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}' and nccl[-2:] == ["--seed", "3"]
    assert server_flags(v, colocate=False, weight_sync="disk", model_dtype="bfloat16")[:2] == ["--dtype", "bfloat16"]
    assert server_flags(VLLMConfig(dtype="float16"), colocate=False, weight_sync="disk")[:2] == ["--dtype", "float16"]
    ipc = server_flags(VLLMConfig(enforce_eager=False), colocate=True, weight_sync="tensor")
    assert "--enable-sleep-mode" in ipc and '{"backend": "ipc"}' in ipc and "--enforce-eager" not in ipc
    assert server_env(v, weight_sync="disk") == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert server_env(v, weight_sync="tensor")["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_cpu_core_binding_spreads_servers(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cores = [server_env(VLLMConfig(), weight_sync="disk", cpu_core=k)["VLLM_CPU_OMP_THREADS_BIND"] for k in range(3)]
    assert cores == ["0", "1", "0"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's own binding wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(VLLMConfig(), weight_sync="disk", cpu_core=1)


def test_command_line_environment_and_groups(no_env, tmp_path):
    server = VLLMServer(tmp_path / "m", port=31001, tp_size=2, gpu_ids=[4, 5], flags=["--dtype", "auto"],
                        python="/opt/vllm/bin/python")
    assert server.command_line() == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     str(tmp_path / "m"), "--host", "127.0.0.1", "--port", "31001",
                                     "--tensor-parallel-size", "2", "--dtype", "auto"]
    env = server.environment()
    assert (env["CUDA_VISIBLE_DEVICES"], env["VLLM_SERVER_DEV_MODE"], env["VLLM_NO_USAGE_STATS"],
            env["HF_HUB_OFFLINE"]) == ("4,5", "1", "1", "1")
    custom = VLLMServer(None, port=31002, command=["srun", "x", "--port", "{port}", "--host", "{host}"])
    assert custom.command_line() == ["srun", "x", "--port", "31002", "--host", "127.0.0.1"]
    assert gpu_groups([0, 1, 2, 3], 2) == [[0, 1], [2, 3]] and gpu_groups([], 2) == [None]
    with pytest.raises(ValueError, match="2 gpu_ids for tp_size=1"):
        VLLMServer(tmp_path, gpu_ids=[0, 1])


def test_cuda_only_settings_are_refused_on_cpu_before_a_server_starts():
    from hacrl_megatron.rollout.vllm_server import check_cpu_settings

    check_cpu_settings(False, "disk")
    with pytest.raises(ValueError, match="rollout.colocate=true: a CPU vLLM server has no sleep mode"):
        check_cpu_settings(True, "disk")
    for mode in ("tensor", "distributed"):
        with pytest.raises(ValueError, match=f"rollout.weight_sync={mode}: vLLM's weight-transfer engines"):
            check_cpu_settings(False, mode)


def test_cpu_head_sizes_are_checked_before_a_server_starts():
    from transformers import LlamaConfig, Qwen3Config

    check_cpu_head_size("llama", LlamaConfig(hidden_size=128, num_attention_heads=4))  # 32: served
    with pytest.raises(ValueError, match=r"agent 'qwen3': head size 24 .* not one vLLM's CPU attention supports "
                                         r"\[32, 64, 80"):
        check_cpu_head_size("qwen3", Qwen3Config(hidden_size=96, num_attention_heads=4, head_dim=24))


# --------------------------------------------------------------------------------------------
# the client against a stand-in that answers like vLLM 0.32


class StandIn:
    """Records every request; answers /v1/completions with ``script(payload)`` choices."""

    def __init__(self, script):
        self.requests: list[tuple[str, dict]] = []
        self.script = script
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stand_in.requests.append((self.path, {}))
                self._reply(200, {"data": [{"id": "/models/init"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stand_in.requests.append((self.path, payload))
                if self.path != "/v1/completions":
                    return self._reply(200, {})
                choices = stand_in.script(payload)
                if isinstance(choices, str):
                    return self._reply(400, {"error": {"message": choices}})
                self._reply(200, {"choices": choices})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in():
    servers = []

    def make(script):
        servers.append(StandIn(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def by_seed(payload):
    """A sample that depends on its seed only: its last token says how it ended."""
    seed = payload.get("seed", 0)
    ends = {0: ([3, 4, EOS], "stop", None), 1: ([5, 9], "stop", 9), 2: ([6, 7, 8], "length", None),
            3: ([7, 2, 2], "stop", "22")}
    ids, reason, stop = ends[seed % 4]
    return [{"index": 0, "text": "server text", "token_ids": [seed % 50 + 10, *ids], "finish_reason": reason,
             "stop_reason": stop}]


def test_each_sample_is_one_request_with_its_own_seed_and_endings_are_read(stand_in):
    s = stand_in(by_seed)
    engine = VLLMEngine(s.url, eos_token_id=EOS)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_new_tokens=5, stop_token_ids=(9,), stop=("22",))
    seeds = [4, 9, 14, 19, 24, 29]
    out = engine.generate_seeded([[1, 2], [3]], params, seeds)
    sent = [p for path, p in s.requests if path == "/v1/completions"]
    assert sorted(p["seed"] for p in sent) == seeds and {p["n"] for p in sent} == {1}
    assert {tuple(p["prompt"]) for p in sent} == {(1, 2), (3,)}
    one = sent[0]
    assert (one["model"], one["temperature"], one["top_p"], one["top_k"], one["max_tokens"]) == (
        "/models/init", 0.8, 0.9, -1, 5)
    assert one["stop_token_ids"] == [EOS, 9] and one["stop"] == ["22"] and one["return_token_ids"] is True
    assert [[c.finish_reason for c in g] for g in out] == [["eos", "stop", "length"], ["stop", "eos", "stop"]]
    assert out[0][0].token_ids == (14, 3, 4) and out[0][1].token_ids == (19, 5)  # eos / stop id left out
    assert out[1][0].token_ids == (29, 7, 2, 2)  # a stop string's tokens stay
    assert out[0][2].text == "server text" and engine.stats()["sequences"] == 6 and engine.stats()["requests"] == 6
    assert engine.stats()["tokens"] == 4 + 3 + 4 + 4 + 4 + 3  # every generated id, ending ones included


def test_greedy_sends_one_request_per_prompt_and_the_pool_seeds_per_sample(stand_in):
    s = stand_in(lambda p: "n must be 1 when using greedy sampling" if p["n"] != 1 else by_seed(p))
    engine = VLLMEngine(s.url, model="m", eos_token_id=EOS)
    out = engine.generate([[1], [2]], SamplingParams(n=4, temperature=0, max_new_tokens=3))
    assert [len(g) for g in out] == [4, 4] and all(len(set(g)) == 1 for g in out)
    assert len(s.requests) == 2 and all("seed" not in p for _, p in s.requests)
    pool = EnginePool([engine], DiskTransport("/nonexistent"), name="a")
    assert pool.runs_in_process is False
    s.requests.clear()
    pool.generate([[1], [2]], SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=11))
    assert sorted(p["seed"] for _, p in s.requests) == sorted(sample_seeds(11, 4))
    with pytest.raises(VLLMError, match="HTTP 400: .*n must be 1 when using greedy sampling"):
        engine.post("/v1/completions", {"n": 2, "model": "m", "prompt": [1]})


def test_sequence_logprob_sums_the_response_tokens(stand_in):
    table = {1: -0.5, 2: -1.25, 3: -2.0, 4: -0.125}

    def prompt_logprobs(p):
        ids = p["prompt"]
        entries = [None] + [{str(t): {"logprob": table[t], "rank": 1}} for t in ids[1:]]
        return [{"index": 0, "token_ids": [1], "finish_reason": "length", "prompt_logprobs": entries}]

    engine = VLLMEngine(stand_in(prompt_logprobs).url, model="m", eos_token_id=EOS)
    assert engine.sequence_logprob([1, 2], [3, 4, 3]) == -2.0 - 0.125 - 2.0
    assert engine.sequence_logprob([1], []) == 0.0
    wrong = VLLMEngine(stand_in(lambda p: [{"index": 0, "prompt_logprobs": [None, {"7": {"logprob": -1.0}}]}]).url,
                       model="m", eos_token_id=EOS)
    with pytest.raises(VLLMError, match="prompt_logprobs at position 1 do not hold token 2"):
        wrong.sequence_logprob([1], [2])


def test_disk_reload_routes_and_memory_routes(stand_in):
    s = stand_in(by_seed)
    engine = VLLMEngine(s.url, model="m", eos_token_id=EOS)
    engine.update_weights_from_disk("/sync/v3", 3)
    assert s.requests == [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/sync/v3"}}),
                          ("/reset_prefix_cache", {}), ("/update_weight_version", {"new_version": "3"})]
    assert engine.weight_version == 3
    s.requests.clear()
    engine.release_memory()
    engine.resume_memory(["weights"])
    engine.resume_memory()
    assert [p for p, _ in s.requests] == ["/sleep?level=1", "/wake_up?tags=weights", "/wake_up"]
    detached = pickle.loads(pickle.dumps(engine.detached()))
    assert (detached.base_url, detached.model, detached.server, detached.tokenizer) == (engine.base_url, "m", None, None)


def test_a_closed_port_is_unreachable_and_restart_needs_a_server():
    from hacrl_megatron.net import free_port
    from hacrl_megatron.rollout.protocol import EngineError, EngineUnreachable

    engine = VLLMEngine(f"http://127.0.0.1:{free_port('127.0.0.1')}", model="m", eos_token_id=EOS, timeout=5)
    assert not engine.health() and not engine.alive()
    with pytest.raises(VLLMUnreachable) as err:
        engine.generate([[1]], SamplingParams(n=1, max_new_tokens=2, seed=1))
    assert isinstance(err.value, EngineUnreachable)  # the pool restarts such an engine
    with pytest.raises(EngineError, match="no server handle to restart"):
        engine.restart()


# --------------------------------------------------------------------------------------------
# the pool and the transports


def test_pool_reachability_runs_in_process_and_make_transport(tmp_path):
    from hacrl_megatron.exchange import load_tokenizer
    from tests.unit.test_rollout_hf import tiny_llama

    tok = load_tokenizer("char", tmp_path / "tok")
    vllm, hf = VLLMEngine("http://127.0.0.1:1", model="m", eos_token_id=EOS), HFEngine(tiny_llama(len(tok)), tok)
    assert EnginePool([hf], DiskTransport(tmp_path)).runs_in_process is True
    assert EnginePool([vllm, hf], DiskTransport(tmp_path)).runs_in_process is True  # one in-process client suffices
    assert EnginePool([vllm], VLLMIPCTransport()).runs_in_process is False
    EnginePool([vllm], VLLMNCCLTransport())
    with pytest.raises(ValueError, match=r"\(VLLMEngine\) cannot take weights by tensor: it lacks "
                                         r"\['update_weights_from_tensor'\]"):
        EnginePool([vllm], TensorTransport())
    r = load_config("cpu_demo", ["rollout.engine=vllm"]).rollout
    kinds = {}
    for mode in ("disk", "tensor", "distributed"):
        r.weight_sync = mode
        kinds[mode] = type(make_transport(r, "a", tmp_path, None)).__name__
    assert kinds == {"disk": "DiskTransport", "tensor": "VLLMIPCTransport", "distributed": "VLLMNCCLTransport"}


def vllm_consumer_chunks(metas: list[tuple[str, list[int], torch.dtype]], buffer_bytes: int) -> list[list[str]]:
    """vLLM 0.32's ``packed_nccl_broadcast_consumer`` chunking, transcribed (names per broadcast)."""
    out, it = [], iter(metas)
    while True:
        chunk, size = [], 0
        try:
            while True:
                name, shape, dtype = next(it)
                chunk.append(name)
                size += math.prod(shape) * dtype.itemsize
                if size > buffer_bytes:
                    break
            out.append(chunk)
        except StopIteration:
            if chunk:
                out.append(chunk)
            break
    return out


@pytest.mark.parametrize("buffer_bytes", [1, 64, 100, 257, 10_000])
def test_nccl_chunks_are_cut_like_vllms_consumer(buffer_bytes):
    g = torch.Generator().manual_seed(buffer_bytes)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    named = [(f"t{i}", torch.zeros(*torch.randint(1, 9, (2,), generator=g).tolist(), dtype=dtypes[i % 3]))
             for i in range(23)]
    ours = [[n for n, _ in c] for c in packed_chunks(named, buffer_bytes)]
    assert ours == vllm_consumer_chunks([(n, list(t.shape), t.dtype) for n, t in named], buffer_bytes)
    chunk = next(packed_chunks(named, buffer_bytes))
    info = chunk_update_info(chunk)
    assert info["names"] == [n for n, _ in chunk] and info["dtype_names"][:2] == ["float32", "bfloat16"][:len(chunk)]
    flat = flat_bytes(chunk, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for _, t in chunk)


def test_nccl_init_info_is_vllms_unique_id_form():
    info = VLLMNCCLTransport(bucket_bytes=1 << 20).init_info(bytes(range(128)), rank_offset=3, world_size=5)
    assert base64.b64decode(info.pop("nccl_unique_id_b64"), validate=True) == bytes(range(128))
    assert info == {"rank_offset": 3, "world_size": 5, "packed": True, "packed_buffer_size_bytes": 1 << 20,
                    "packed_num_buffers": 2}


def test_ipc_update_info_carries_one_uuid_keyed_handle_per_tensor():
    bucket = [("a.weight", torch.ones(2, 3)), ("b.bias", torch.zeros(4, dtype=torch.bfloat16))]
    info = bucket_update_info(bucket, handle=lambda t: {"GPU-uuid-7": ("args", tuple(t.shape))})
    handles = pickle.loads(base64.b64decode(info.pop("ipc_handles_pickled")))
    assert handles == [{"GPU-uuid-7": ("args", (2, 3))}, {"GPU-uuid-7": ("args", (4,))}]
    assert info == {"names": ["a.weight", "b.bias"], "dtype_names": ["float32", "bfloat16"], "shapes": [[2, 3], [4]]}


# --------------------------------------------------------------------------------------------
# the image


def test_dockerfile_builds_a_vllm_venv_only_when_asked():
    dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="pip install 'hacrl_megatron[dev]'")
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "Dockerfile"
    structure = dockerfile_parse.DockerfileParser(path=str(path)).structure
    args = [ins["value"] for ins in structure if ins["instruction"] == "ARG"]
    assert 'VLLM_REQUIREMENT=""' in args  # default: no vLLM venv (hadolint runs in test_dockerfile.py)
    (run,) = [ins["value"] for ins in structure if ins["instruction"] == "RUN" and "VLLM_REQUIREMENT" in ins["value"]]
    assert run.startswith('if [ -n "${VLLM_REQUIREMENT}" ]; then') and run.count('PIP_CONSTRAINT=""') == 2
    assert "/opt/vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec" in run
    envs = [ins["value"] for ins in structure if ins["instruction"] == "ENV"]
    assert f"{VLLM_PYTHON_ENV}=/opt/vllm/bin/python" in envs


def test_disk_folders_of_tied_models_hold_the_lm_head(tmp_path):
    """vLLM's in-place reload keeps a tied LM head on its old values unless the folder holds it
    (sync/disk.py); a Megatron export sends the shared tensor once, as the embedding."""
    from safetensors.torch import load_file

    embed, norm = torch.randn(5, 3), torch.ones(3)
    for tied, stream, expect in [
        (True, [("model.embed_tokens.weight", embed), ("model.norm.weight", norm)],
         ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]),
        (True, [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)],
         ["lm_head.weight", "model.embed_tokens.weight"]),
        (False, [("model.embed_tokens.weight", embed), ("model.norm.weight", norm)],
         ["model.embed_tokens.weight", "model.norm.weight"]),
    ]:
        base = tmp_path / f"base{tied}{len(expect)}"
        base.mkdir()
        (base / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
        transport = DiskTransport(tmp_path / f"sync{tied}{len(expect)}", base, shard_bytes=40)
        folder, count = transport.write(iter(stream), 1)
        tensors = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert count == len(stream) and sorted(tensors) == sorted(index) == expect
        if tied:
            assert torch.equal(tensors["lm_head.weight"], embed)
