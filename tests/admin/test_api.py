"""The admin HTTP layer (admin/api.py) against a stand-in for the
engine's StorageControl: authentication, body validation (nothing reaches
the engine on a bad call), the legacy form, timeouts, binding. The engine
side is tests/admin/test_storage_control.py; both together with a real server
in tests/e2e/test_admin_api.py."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import Future

import pytest
from fastapi.testclient import TestClient

from vllm_hicache.admin.api import (
    AdminServer,
    BodyError,
    build_app,
    parse_attach,
)
from vllm_hicache.config import HiCacheConfig

KEY = "k" * 32
PATH = "/hicache/storage-backend"


class FakeControl:
    """Answers every command at once (or never, with ``answer=False``)."""

    drain_timeout_s = 0.1
    ack_timeout_s = 0.1

    def __init__(self, answer: bool = True) -> None:
        self.answer = answer
        self.calls: list[tuple[str, object]] = []
        self.withdrawn: list[Future] = []
        self.closed = False
        self.waker = None

    def submit(self, kind, spec=None) -> Future:
        self.calls.append((kind, spec))
        future: Future = Future()
        if self.answer:
            future.set_result((200, {"kind": kind}))
        return future

    def withdraw(self, future) -> bool:
        self.withdrawn.append(future)
        future.cancel()
        return True

    def close(self) -> None:
        self.closed = True


def client(control=None, key: str = KEY, **kw) -> tuple[TestClient, FakeControl]:
    control = control or FakeControl()
    return TestClient(build_app(control, key, **kw)), control


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [
    {}, auth("wrong-key-" + "x" * 22), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
])
def test_every_route_needs_the_key(headers):
    http, control = client()
    for method, path in [("GET", PATH), ("PUT", PATH), ("DELETE", PATH),
                         ("POST", PATH + "/clear"), ("POST", "/set_hicache_storage_backend")]:
        resp = http.request(method, path, headers=headers, json={"backend": "file"})
        assert resp.status_code == 401, (method, path)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert control.calls == []


def test_the_key_opens_every_route():
    http, control = client()
    assert http.get(PATH, headers=auth()).json() == {"kind": "get"}
    assert http.delete(PATH, headers=auth()).json() == {"kind": "detach"}
    assert http.post(PATH + "/clear", headers=auth()).json() == {"kind": "clear"}
    resp = http.put(PATH, headers=auth(), json={"backend": "file", "extra_config": {"path": "/x"}})
    assert resp.status_code == 200 and resp.json() == {"kind": "attach"}
    _, spec = control.calls[-1]
    assert spec.backend == "file" and dict(spec.storage.backend_options) == {"path": "/x"}
    assert not spec.prefetch_policy_given and spec.write_policy is None


def test_no_key_configured_needs_no_header():
    http, _ = client(key="")
    assert http.get(PATH).status_code == 200


@pytest.mark.parametrize("body, field", [
    (b"{not json", "body"),
    (b"", "body"),
    (b"[1, 2]", "body"),
    (json.dumps({"backend": "file", "colour": "red"}).encode(), "colour"),
    (json.dumps({"extra_config": {}}).encode(), "backend"),
    (json.dumps({"backend": "s3"}).encode(), "backend"),
    (json.dumps({"backend": 7}).encode(), "backend"),
    (json.dumps({"hicache_storage_backend": "file", "backend": "file"}).encode(), "backend"),
    (json.dumps({"backend": "file", "prefetch_policy": "eager"}).encode(), "prefetch_policy"),
    (json.dumps({"backend": "file", "hicache_write_policy": "sometimes"}).encode(),
     "hicache_write_policy"),
    (json.dumps({"backend": "file", "extra_config": [1]}).encode(), "extra_config"),
    (json.dumps({"backend": "file", "extra_config": "{bad"}).encode(), "extra_config"),
    (json.dumps({"backend": "file", "extra_config": "@/etc/passwd"}).encode(), "extra_config"),
    (json.dumps({"backend": "file", "hicache_storage_backend_extra_config_json":
                 {"prefetch_threshold": -1}}).encode(),
     "hicache_storage_backend_extra_config_json"),
])
def test_bad_bodies_are_400_naming_the_field_and_reach_nothing(body, field):
    http, control = client()
    resp = http.put(PATH, headers=auth(), content=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["field"] == field, resp.json()
    assert control.calls == []  # the engine never saw it


def test_unknown_backend_lists_the_known_ones():
    http, control = client()
    resp = http.put(PATH, headers=auth(), json={"backend": "tape"})
    assert resp.status_code == 400 and "file" in resp.json()["error"]
    assert control.calls == []


def test_legacy_form():
    http, control = client()
    resp = http.post("/set_hicache_storage_backend", headers=auth(),
                     json={"storage_backend": None})
    assert resp.json() == {"kind": "detach"}
    resp = http.post("/set_hicache_storage_backend", headers=auth(), json={
        "storage_backend": "mooncake",
        "hicache_storage_backend_extra_config_json": json.dumps({"master_server_address": "h:1"}),
        "hicache_storage_prefetch_policy": "timeout", "hicache_write_policy": "write_through"})
    assert resp.json() == {"kind": "attach"}
    _, spec = control.calls[-1]
    assert spec.backend == "mooncake" and spec.storage.prefetch_policy == "timeout"
    assert spec.prefetch_policy_given and spec.extra_config_given
    assert spec.write_policy == "write_through"
    resp = http.post("/set_hicache_storage_backend", headers=auth(), json={"storage_backend": "x"})
    assert resp.status_code == 400 and resp.json()["field"] == "storage_backend"


def test_a_call_the_engine_never_takes_is_withdrawn():
    http, control = client(FakeControl(answer=False), engine_wait_s=0.2)
    resp = http.delete(PATH, headers=auth())
    assert resp.status_code == 503 and "nothing changed" in resp.json()["error"]
    assert len(control.withdrawn) == 1


def test_parse_attach_keeps_what_workers_parse():
    spec = parse_attach({"backend": "file", "extra_config": {"path": "/l3",
                                                             "prefetch_threshold": 64}})
    assert spec.storage_keys == {"hicache_storage_backend": "file",
                                 "hicache_storage_backend_extra_config":
                                     {"path": "/l3", "prefetch_threshold": 64}}
    assert spec.storage.prefetch_threshold == 64
    with pytest.raises(BodyError):
        parse_attach({"storage_backend": None})  # the null form is the legacy route's


def test_server_binds_loopback_and_refuses_a_taken_port():
    server = AdminServer(FakeControl(), "127.0.0.1", 0, KEY).start()
    try:
        req = urllib.request.Request(server.url, headers=auth())
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as resp:
            assert json.loads(resp.read()) == {"kind": "get"}
        with pytest.raises(urllib.error.HTTPError) as err:
            opener.open(server.url, timeout=10)
        assert err.value.code == 401
        with pytest.raises(ValueError, match="admin_api_port"):
            AdminServer(FakeControl(), "127.0.0.1", server.port).start()
    finally:
        server.stop()
    assert server.control.closed
    with socket.socket() as sock:  # the port is free again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))


def test_config_keys(tmp_path):
    cfg = HiCacheConfig.from_extra_config({})
    assert (cfg.admin_api_port, cfg.admin_api_host, cfg.admin_api_key) == (0, "127.0.0.1", "")
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY + "\n")
    cfg = HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "0.0.0.0",
                                           "admin_api_key": f"@{key_file}"})
    assert cfg.admin_api_key == KEY and KEY not in repr(cfg)
    with pytest.raises(ValueError, match="admin_api_key"):
        HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "0.0.0.0"})
    HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "::1"})
    for bad in ({"admin_api_port": 70000}, {"admin_api_port": "80"}, {"admin_api_host": ""},
                {"admin_api_key": "short"}, {"admin_api_key": f"@{tmp_path / 'missing'}"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HiCacheConfig.from_extra_config(bad)
