"""The admin API on a real ``vllm-hicache serve`` (HiCache, file L3 with a
storage secret, admin API on loopback with a key, the test's directory in
admin_api_file_dirs, SGLang's idle rule: admin_storage_switch=idle), one
server per module. Switching while requests run (the default, live):
test_admin_live_switch.py.

The tests run in file order on the shared server and each leaves the file
backend attached:

    auth          401 without or with a wrong key; GET with it (secret redacted)
    bad input     400 naming the field, unknown backend 400; nothing changes
    busy          PUT, DELETE and the legacy form refused (409, with counts)
                  while a streaming request runs; accepted once it is gone
    detach        requests still served, from L2 (L1 reset); no L3 writes
    re-attach     what L2 computed while detached is backed up (backfill); with
                  L1 and L2 reset it comes back from L3
    clear         L3 emptied: the same prompt is then a miss
    legacy        POST /set_hicache_storage_backend null / "file"
    cross-site    text/plain POSTs (415), a foreign Host or Origin (403): refused
    files         an attach naming a file outside admin_api_file_dirs (a Redis
                  password sent to a listener of the client's choosing), a
                  device, a FIFO, a large file, a module not allowed: refused,
                  nothing read, sent or imported; an allowed file is sent

Idle admin calls prove the engine loop is woken (vllm_compat.engine_loop_waker):
an idle EngineCore otherwise blocks until a request arrives.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.test_serve import BLOCK, CLI, TEST_ARGS, Server, _cores
from tests.ports import free_ports
from vllm_hicache.l3.canary import is_canary_key

pytestmark = pytest.mark.engine

KEY = "admin-key-for-tests-0123456789"
CANARY = "hicache_import_canary"
# test_serve's arguments with room for one long request (the busy test):
# L1 = 128 blocks, L2 = 256 pages.
ARGS = list(TEST_ARGS)
ARGS[ARGS.index("--max-model-len") + 1] = "2048"  # the model's limit
ARGS[ARGS.index("--kv-cache-memory-bytes") + 1] = str(4 << 20)
LONG_TOKENS = 1800
PREFIX = [11 + (i * 29) % 450 for i in range(4 * BLOCK)]
# Computed only while L3 is detached: in L3 only if the re-attach backs it up.
DETACHED = [17 + (i * 31) % 440 for i in range(4 * BLOCK)]


def _prompt(k: int, prefix: list[int] = PREFIX) -> list[int]:
    return prefix + [13 + (i * k * 7) % 450 for i in range(20)]


class Admin:
    def __init__(self, server: Server, admin_port: int) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{admin_port}"
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(self, method: str, path: str = "/hicache/storage-backend", body=None,
             key: str | None = KEY, **headers: str) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else (
            json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json",
                   **{name.replace("_", "-"): value for name, value in headers.items()}}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with self.opener.open(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def get(self) -> dict:
        status, body = self.call("GET")
        assert status == 200, body
        return body

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        """Until no request, transfer or backfill is left."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            body = self.get()
            backfill = body["backfill"]
            if (not body["requests"] and not any(body["transfers"].values())
                    and (backfill is None or backfill.get("nodes_left", 0) == 0
                         and not backfill.get("pages_in_flight"))):
                return body
            time.sleep(0.2)
        raise AssertionError(f"engine not idle: {body}")

    def reset(self, external: bool) -> None:
        """vLLM's dev endpoint: drop L1 (and L2 with ``external``)."""
        query = "?reset_external=true" if external else ""
        req = urllib.request.Request(f"{self.server.url}/reset_prefix_cache{query}",
                                     method="POST")
        with self.opener.open(req, timeout=60) as resp:
            assert json.loads(resp.read())["success"] is True


@pytest.fixture(scope="module")
def admin(tiny_model_dir, tmp_path_factory):
    if not CLI.exists():
        pytest.fail(f"{CLI} is missing: run `pip install -e . --no-deps` (or `make setup`)")
    tmp = tmp_path_factory.mktemp("admin")
    (tmp / "admin.key").write_text(KEY + "\n")
    (tmp / "l3.secret").write_text("s3cr3t-" * 6 + "\n")
    # Importable by the engine; records its import (a refused attach must not).
    (tmp / "canary").mkdir()
    (tmp / "canary" / f"{CANARY}.py").write_text(
        f"open({str(tmp / 'imported')!r}, 'w').close()\n")
    api_port, admin_port = free_ports(2)
    extra = {
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {
            "path": str(tmp / "l3"), "prefetch_threshold": BLOCK,
            "storage_secret": f"@{tmp / 'l3.secret'}"},
        "admin_api_port": admin_port, "admin_api_key": f"@{tmp / 'admin.key'}",
        "admin_api_file_dirs": [str(tmp)],
        "admin_storage_switch": "idle",
    }
    config = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
    argv = [str(CLI), "serve", str(tiny_model_dir), "--kv-transfer-config", json.dumps(config),
            *ARGS]
    server = Server("admin", argv, tmp / "server.log", _cores()[-1], api_port)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's /reset_prefix_cache
        mp.setenv("PYTHONPATH", os.pathsep.join(
            [str(tmp / "canary"), *filter(None, [os.environ.get("PYTHONPATH")])]))
        server.start()
    try:
        server.wait_ready()
        yield Admin(server, admin_port), tmp
        log = server.log()  # before the stop: vLLM's own shutdown may log one
        assert "Traceback" not in log, log[-4000:]
    finally:
        server.stop()


def _objects(tmp) -> int:
    """Pages in L3: not the start canaries nor the breaker's health-check
    object, which it may write again at any moment (l3/health_check.py)."""
    return sum(not is_canary_key(p.name.removesuffix(".hckv"))
               for p in (tmp / "l3").rglob("*.hckv"))


def _file_body(tmp, **more) -> dict:
    return {"backend": "file", "extra_config": {
        "path": str(tmp / "l3"), "prefetch_threshold": BLOCK,
        "storage_secret": f"@{tmp / 'l3.secret'}"}, "prefetch_policy": "wait_complete", **more}


def test_auth_and_get(admin):
    admin, tmp = admin
    for key in (None, "wrong-key-0123456789abcdef"):
        status, body = admin.call("GET", key=key)
        assert status == 401, body
    status, body = admin.call("PUT", body={"backend": "file"}, key=None)
    assert status == 401
    body = admin.get()
    assert body["backend"] == "file" and body["state"] == "attached"
    assert body["extra_config"]["path"] == str(tmp / "l3")
    assert body["extra_config"]["storage_secret"] == "<redacted>"
    assert "s3cr3t" not in json.dumps(body)
    assert body["prefetch_policy"] == "wait_complete" and body["write_policy"] == "write_through"
    l2 = body["tiers"]["l2"]
    assert l2["pages_total"] == 256 and l2["pages_used"] + l2["pages_free"] <= 256
    assert "stored_blocks" in body["stats"] and body["l3_stats"] is not None


def test_bad_input_is_400_and_changes_nothing(admin):
    admin, _ = admin
    before = admin.get()
    cases = [
        (b"{oops", "body"),
        ({"backend": "file", "shiny": True}, "shiny"),
        ({"backend": "file", "prefetch_policy": "always"}, "prefetch_policy"),
        ({"backend": "file", "extra_config": "[1]"}, "extra_config"),
        (b"[" * 60_000, "body"),  # once a RecursionError (500)
    ]
    for body, field in cases:
        status, answer = admin.call("PUT", body=body)
        assert status == 400 and answer["field"] == field, (body, answer)
    status, answer = admin.call("PUT", body={"backend": "floppy"})
    assert status == 400 and answer["field"] == "backend"
    status, answer = admin.call("POST", "/set_hicache_storage_backend",
                                body={"storage_backend": 3})
    assert status == 400 and answer["field"] == "storage_backend"
    after = admin.get()
    assert (after["backend"], after["state"], after["extra_config"], after["prefetch_policy"]) == (
        before["backend"], before["state"], before["extra_config"], before["prefetch_policy"])


def _start_stream(server: Server) -> tuple[http.client.HTTPConnection,
                                          http.client.HTTPResponse]:
    """A completion that streams for long; returns once its first token is out."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = json.dumps({"model": "tiny", "prompt": _prompt(90), "max_tokens": LONG_TOKENS,
                       "temperature": 0.0, "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline()  # the first event: the request is running
    return conn, resp


def test_refused_while_a_request_runs(admin):
    admin, tmp = admin
    conn, _ = _start_stream(admin.server)
    try:
        assert admin.get()["requests"] == 1
        for method, path, body in [("DELETE", "/hicache/storage-backend", None),
                                   ("PUT", "/hicache/storage-backend", _file_body(tmp)),
                                   ("POST", "/set_hicache_storage_backend",
                                    {"storage_backend": None})]:
            status, answer = admin.call(method, path, body)
            assert status == 409, (method, answer)
            assert answer["running"] + answer["waiting"] == 1, answer
        assert admin.get()["state"] == "attached"
    finally:
        conn.close()  # vLLM aborts the request
    admin.wait_idle()
    status, answer = admin.call("PUT", body=_file_body(tmp))  # idle: a policy update
    assert status == 200 and answer["message"] == "policies updated", answer


def test_detach_then_requests_are_served_from_l2(admin):
    admin, tmp = admin
    admin.wait_idle()
    status, body = admin.call("DELETE")
    assert status == 200 and body["backend"] is None and body["state"] == "detached", body
    status, body = admin.call("DELETE")  # idempotent
    assert status == 200
    objects = _objects(tmp)
    first = admin.server.complete(_prompt(1, DETACHED))
    admin.reset(external=False)  # L1 only
    again = admin.server.complete(_prompt(1, DETACHED))
    assert (again["text"], again["token_ids"]) == (first["text"], first["token_ids"])
    assert again["cached"] >= len(DETACHED)  # from L2
    assert _objects(tmp) == objects  # nothing went to L3


def test_reattach_backs_up_l2_and_serves_from_l3(admin):
    admin, tmp = admin
    admin.wait_idle()
    objects = _objects(tmp)
    status, body = admin.call("PUT", body=_file_body(tmp))
    assert status == 200 and body["state"] == "attached", body
    body = admin.wait_idle()
    assert body["backfill"]["pages_queued"] >= len(DETACHED) // BLOCK
    # DETACHED's blocks, computed while detached, reached L3 by the backfill.
    assert _objects(tmp) >= objects + len(DETACHED) // BLOCK
    expected = admin.server.complete(_prompt(1, DETACHED))
    admin.reset(external=True)  # L1 and L2
    hits = admin.server.metric("vllm:external_prefix_cache_hits_total")
    again = admin.server.complete(_prompt(1, DETACHED))
    assert (again["text"], again["token_ids"]) == (expected["text"], expected["token_ids"])
    assert again["cached"] >= len(DETACHED)  # keys as lookups make them
    assert admin.server.metric("vllm:external_prefix_cache_hits_total") - hits >= len(DETACHED)
    assert admin.get()["l3_stats"]["prefetched_blocks"] >= len(DETACHED) // BLOCK


def test_clear_empties_l3(admin):
    admin, tmp = admin
    admin.wait_idle()
    status, body = admin.call("POST", "/hicache/storage-backend/clear")
    assert status == 200 and body["message"] == "cleared", body
    assert _objects(tmp) == 0
    admin.reset(external=True)
    again = admin.server.complete(_prompt(1, DETACHED))
    assert again["cached"] == 0


def test_legacy_form(admin):
    admin, tmp = admin
    admin.wait_idle()
    status, body = admin.call("POST", "/set_hicache_storage_backend", {"storage_backend": None})
    assert status == 200 and body["backend"] is None, body
    legacy = {"storage_backend": "file",
              "hicache_storage_backend_extra_config_json": json.dumps(
                  _file_body(tmp)["extra_config"]),
              "hicache_storage_prefetch_policy": "best_effort"}
    status, body = admin.call("POST", "/set_hicache_storage_backend", legacy)
    assert status == 200 and body["backend"] == "file", body
    assert body["prefetch_policy"] == "best_effort"
    status, body = admin.call("PUT", body={"backend": "redis", "extra_config": {}})
    assert status == 409 and "detach it first" in body["error"]


def test_cross_site_calls_are_refused(admin):
    """What a web page on this host could send: a text/plain POST (no
    preflight) is 415, a foreign Host (DNS rebinding) or Origin is 403, all
    before anything runs; JSON with the key works."""
    admin, tmp = admin
    admin.wait_idle()
    objects = _objects(tmp)
    assert objects > 0
    for path, body in (("/hicache/storage-backend/clear", b""),
                       ("/set_hicache_storage_backend", b'{"storage_backend": null}')):
        status, answer = admin.call("POST", path, body, Content_Type="text/plain")
        assert status == 415 and "application/json" in answer["error"], answer
        for header, value in (("Host", "evil.example"), ("Origin", "http://evil.example")):
            status, answer = admin.call("POST", path, body, **{header: value})
            assert status == 403 and answer["field"] == header, answer
    status, answer = admin.call("GET", Host="evil.example")
    assert status == 403
    assert _objects(tmp) == objects
    body = admin.get()
    assert body["state"] == "attached" and body["backend"] == "file"


class FakeRedis:
    """A TCP listener standing in for a Redis server: records every byte
    any client sends, answers each read with an error."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    while data := conn.recv(65536):
                        self.received += data
                        conn.sendall(b"-ERR no\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_attach_reads_no_file_outside_the_allowed_dirs(admin, tmp_path_factory):
    """Detached (so an attach would build its backend): a Redis attach whose
    password names a private file sends nothing to the listener the client
    chose; storage_secret as a device, a FIFO or a large file is a quick 400;
    a module not allowed is not imported. The same listener does receive a
    password file from the allowed directory: the check is not vacuous."""
    admin, tmp = admin
    admin.wait_idle()
    private = tmp_path_factory.mktemp("home") / "id_ed25519"
    private.write_text("PRIVATE-KEY-BYTES-0123456789\n")
    os.mkfifo(tmp / "fifo")
    (tmp / "big.secret").write_bytes(b"b" * (1 << 20))
    (tmp / "redis.pw").write_text("allowed-password-0123\n")
    status, body = admin.call("DELETE")
    assert status == 200 and body["state"] == "detached", body
    fake = FakeRedis()
    try:
        redis = {"url": f"redis://127.0.0.1:{fake.port}", "startup_wait_s": 0}
        refused = [
            ({"backend": "redis", "extra_config": {**redis, "password": f"@{private}"}},
             "names a file"),
            ({"backend": "redis", "extra_config": {**redis, "password": f"@{tmp}/../x"}},
             "names a file"),
            ({"backend": "file", "extra_config": {"path": str(tmp / "l3"),
                                                  "storage_secret": f"@{private}"}},
             "names a file"),
            ({"backend": "file", "extra_config": {"path": str(tmp / "l3"),
                                                  "storage_secret": "@/dev/zero"}},
             "names a file"),
            ({"backend": "file", "extra_config": {"path": str(tmp / "l3"),
                                                  "storage_secret": f"@{tmp}/fifo"}},
             "not a regular file"),
            ({"backend": "file", "extra_config": {"path": str(tmp / "l3"),
                                                  "storage_secret": f"@{tmp}/big.secret"}},
             "larger than the limit of 65536 bytes"),
            ({"backend": "dynamic", "extra_config": {"module_path": CANARY,
                                                     "class_name": "Backend"}},
             "admin_api_dynamic_modules"),
        ]
        for body, problem in refused:
            start = time.monotonic()
            status, answer = admin.call("PUT", body=body)
            assert status == 400 and problem in answer["error"], (body, answer)
            assert answer["field"] == "extra_config"
            assert time.monotonic() - start < 10
        time.sleep(0.5)
        assert fake.connections == 0 and bytes(fake.received) == b""
        assert not (tmp / "imported").exists()
        assert admin.get()["state"] == "detached"
        # The control: a password file the operator allowed is read and sent.
        status, answer = admin.call("PUT", body={
            "backend": "redis", "extra_config": {**redis, "password": f"@{tmp}/redis.pw"}})
        assert status in (400, 502) and "redis" in answer["error"], answer  # no server there
        assert b"allowed-password-0123" in fake.received
        assert b"PRIVATE-KEY-BYTES" not in fake.received
    finally:
        fake.close()
    status, body = admin.call("PUT", body=_file_body(tmp))
    assert status == 200 and body["state"] == "attached", body
