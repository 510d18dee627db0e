"""The redis exchange backend's connection rules on a real redis-server: password from a file, TLS for
``rediss://`` with certificate verification, and one-line errors naming the server or the file.

Skipped without ``redis-server`` (and ``openssl`` for the TLS case) unless ``HACRL_REQUIRE_REDIS=1``.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest

from hacrl_megatron.exchange.remote import KeyFileError, open_store
from hacrl_megatron.exchange.remote.redis_store import ExchangeBackendError
from tests.fixtures.redis_server import REQUIRE_ENV, redis_server, start_redis, stop_redis  # noqa: F401
from tests.fixtures.required import skip_or_fail
from tests.unit.test_peer_exchange_record import make_record

pytestmark = pytest.mark.redis


def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def test_password_rules(redis_server, tmp_path):  # noqa: F811 - the fixture
    with pytest.raises(ExchangeBackendError, match=rf"exchange redis server {redis_server.url}: PING failed"):
        open_store("redis", run_id(), redis_url=redis_server.url)  # no password: the server says NOAUTH
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    with pytest.raises(ExchangeBackendError, match="PING failed"):
        open_store("redis", run_id(), redis_url=redis_server.url, redis_password_file=wrong)
    wrong.chmod(0o644)
    with pytest.raises(KeyFileError, match=f"exchange.redis_password_file {wrong}: readable or writable by every"):
        open_store("redis", run_id(), redis_url=redis_server.url, redis_password_file=wrong)


def test_unreachable_server_is_one_line_naming_it(tmp_path):
    pytest.importorskip("redis")
    from tests.fixtures.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(ExchangeBackendError) as err:
        open_store("redis", run_id(), redis_url=url)
    assert str(err.value).startswith(f"exchange redis server {url}: PING failed: ConnectionError")


def self_signed_cert(folder):
    """A certificate (its own CA) for 127.0.0.1, made with the openssl command."""
    if shutil.which("openssl") is None:
        skip_or_fail(REQUIRE_ENV, "no openssl command for the TLS test")
    cert, key = folder / "server.crt", folder / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    key.chmod(0o600)
    return cert, key


def test_tls_round_trip_verifies_the_server(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    proc, server = start_redis(tmp_path, tls=(cert, key))
    try:
        assert server.url.startswith("rediss://")
        rid = run_id()
        with open_store("redis", rid, redis_url=server.url, redis_password_file=server.password_file,
                        redis_ca_file=cert) as store:
            record = make_record(step=0, agent="agent1", run_id=rid)
            store.publish(record)
            assert store.wait_for(0, ["agent1"], wait_s=1).records == {"agent1": record}
        # without the CA the server's certificate is not trusted: refused, naming the server
        with pytest.raises(ExchangeBackendError, match=rf"{server.url}: PING failed: .*certificate verify failed"):
            open_store("redis", rid, redis_url=server.url, redis_password_file=server.password_file)
    finally:
        stop_redis(proc)
