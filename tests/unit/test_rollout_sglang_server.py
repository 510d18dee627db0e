"""SGLangServer process management, with a stand-in server process (no GPU, no sglang here).

The stand-in is a small Python HTTP server answering /health, launched through ``command=`` (in
milliseconds; the real ``python -m sglang.launch_server`` on CPU takes minutes to start: it runs in
tests/conformance/ and tests/e2e/test_rollout_sglang.py, CI's SGLang step).
"""

from __future__ import annotations

import sys

import pytest

from hacrl_megatron.rollout.sglang_server import SGLangServer, SGLangServerError

STANDIN = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "print('serving', flush=True)\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def test_start_health_restart_stop(tmp_path):
    server = SGLangServer(None, command=[sys.executable, "-c", STANDIN, "{port}"], log_path=tmp_path / "s.log")
    with server:
        assert server.is_running() and server.healthy()
        first_pid = server.process.pid
        url = server.restart(timeout=30)
        assert url == server.base_url and server.healthy() and server.restarts == 1
        assert server.process.pid != first_pid
        with pytest.raises(SGLangServerError, match="already running"):
            server.start()
    assert not server.is_running() and not server.healthy(timeout=0.5)
    assert "serving" in (tmp_path / "s.log").read_text()
    server.stop()  # idempotent


def test_failed_start_reports_log(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('boom: no CUDA'); sys.exit(3)"]
    server = SGLangServer(None, command=crash, log_path=tmp_path / "c.log")
    with pytest.raises(SGLangServerError, match=r"(?s)exited with code 3.*boom: no CUDA"):
        server.start(timeout=30, interval=0.1)
    assert not server.is_running()


def test_command_line_and_validation(tmp_path):
    s = SGLangServer(tmp_path / "model", port=31000, tp_size=2, gpu_ids=[2, 3], mem_fraction_static=0.5,
                     extra_args=["--enable-memory-saver"])
    cmd = s.command_line()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == ["--model-path", str(tmp_path / "model"), "--host", "127.0.0.1", "--port", "31000",
                       "--tp-size", "2", "--mem-fraction-static", "0.5", "--enable-memory-saver"]
    with pytest.raises(ValueError, match="2 gpu_ids for tp_size=1"):
        SGLangServer(tmp_path, gpu_ids=[0, 1])
    with pytest.raises(ValueError, match="model_path is required"):
        SGLangServer(None)


# A stand-in that also speaks /generate and /update_weights_from_disk: it answers prompt [.., t] with
# [t+1, t+2] + eos once weights were loaded from disk, and with [t+10] + eos before. It forgets
# everything when it dies, like a real server.
GENERATING = (
    "import http.server, json, sys\n"
    "state = {'weights': None}\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def log_message(self, *a): pass\n"
    "    def _send(self, obj):\n"
    "        body = json.dumps(obj).encode(); self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body))); self.end_headers(); self.wfile.write(body)\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers()\n"
    "    def do_POST(self):\n"
    "        req = json.loads(self.rfile.read(int(self.headers['Content-Length'])))\n"
    "        if self.path == '/update_weights_from_disk':\n"
    "            state['weights'] = req['model_path']; return self._send({'success': True, 'message': ''})\n"
    "        out = []\n"
    "        for ids in req['input_ids']:\n"
    "            new = [ids[-1] + 1, ids[-1] + 2] if state['weights'] else [ids[-1] + 10]\n"
    "            out.append({'text': '', 'output_ids': new + [0],\n"
    "                        'meta_info': {'finish_reason': {'type': 'stop', 'matched': 0}}})\n"
    "        self._send(out)\n"
    "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def test_pool_restarts_dead_server_and_restores_disk_weights(tmp_path):
    import torch

    from hacrl_megatron.rollout import EngineError, EnginePool, SamplingParams, SGLangEngine
    from hacrl_megatron.sync.disk import DiskTransport

    server = SGLangServer(None, command=[sys.executable, "-c", GENERATING, "{port}"], log_path=tmp_path / "g.log")
    with server:
        engine = SGLangEngine(server.base_url, eos_token_id=0, server=server)
        pool = EnginePool([engine], DiskTransport(tmp_path / "sync"))
        params = SamplingParams(n=2, max_new_tokens=4)
        assert pool.generate([[5]], params)[0][0].token_ids == (15,)  # initial weights
        pool.load_weights([("w", torch.ones(2))])
        synced = pool.generate([[5], [7]], params)
        assert [c.token_ids for c in synced[1]] == [(8, 9), (8, 9)] and synced[1][0].finish_reason == "eos"
        server.process.kill()  # our own child: simulate a crash
        server.process.wait()
        assert pool.generate([[5], [7]], params) == synced  # restarted, synced weights reloaded from disk
        assert engine.restarts == 1 and server.restarts == 1 and pool.stats()["restarts"] == 1
        # without an attached server there is nothing to restart: the error surfaces
        server.process.kill()
        server.process.wait()
        bare = EnginePool([SGLangEngine(server.base_url, eos_token_id=0, timeout=2)], DiskTransport(tmp_path / "s2"))
        with pytest.raises(EngineError, match="no engine can generate .*no server handle to restart"):
            bare.generate([[5]], params)
