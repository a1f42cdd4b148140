"""The admin HTTP layer (admin/api.py) against a stand-in for the
engine's StorageControl: authentication, Host / Origin / Content-Type checks,
body validation and limits, what a body may name (files, modules:
admin/guard.py), the generated key file (admin/key_file.py), the legacy form,
timeouts, binding. Nothing reaches the engine on a refused call. The engine
side is tests/admin/test_storage_control.py; both together with a real server
in tests/e2e/test_admin_api.py."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future

import pytest
from fastapi.testclient import TestClient

from vllm_hicache.admin.api import (
    MAX_BODY_BYTES,
    AdminServer,
    BodyError,
    build_app,
    parse_attach,
)
from vllm_hicache.admin.guard import AdminPolicy
from vllm_hicache.config import HiCacheConfig
from vllm_hicache.config_admin import admin_key_file

KEY = "k" * 32
PATH = "/hicache/storage-backend"
# The address the apps under test are "bound" to (Host checks).
BOUND, PORT = "127.0.0.1", 8123
JSON = {"Content-Type": "application/json"}


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


def client(control=None, key: str = KEY, host: str = BOUND,
           **kw) -> tuple[TestClient, FakeControl]:
    control = control or FakeControl()
    app = build_app(control, key, host=host, port=PORT, **kw)
    netloc = f"[{host}]" if ":" in host else host
    return TestClient(app, base_url=f"http://{netloc}:{PORT}"), control


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def auth_json(key: str = KEY) -> dict[str, str]:
    return {**auth(key), **JSON}


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
    assert http.post(PATH + "/clear", headers=auth_json()).json() == {"kind": "clear"}
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
    resp = http.put(PATH, headers=auth_json(), content=body)
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


def test_pending_backups_field():
    """PUT takes finish | drop | move (default finish); DELETE takes an
    optional body with finish | drop (nothing to move to)."""
    http, control = client()
    resp = http.put(PATH, headers=auth(), json={"backend": "file", "pending_backups": "move"})
    assert resp.status_code == 200
    assert control.calls[-1][1].pending_backups == "move"
    http.put(PATH, headers=auth(), json={"backend": "file"})
    assert control.calls[-1][1].pending_backups == "finish"
    resp = http.put(PATH, headers=auth(), json={"backend": "file", "pending_backups": "later"})
    assert resp.status_code == 400 and resp.json()["field"] == "pending_backups"
    assert http.delete(PATH, headers=auth()).json() == {"kind": "detach"}
    assert control.calls[-1][1].pending_backups == "finish"
    resp = http.request("DELETE", PATH, headers=auth_json(),
                        content=json.dumps({"pending_backups": "drop"}))
    assert resp.status_code == 200 and control.calls[-1][1].pending_backups == "drop"
    calls = len(control.calls)
    for body, field in (({"pending_backups": "move"}, "pending_backups"),
                        ({"backend": "file"}, "backend"), ([1], "body")):
        resp = http.request("DELETE", PATH, headers=auth_json(), content=json.dumps(body))
        assert resp.status_code == 400 and resp.json()["field"] == field, resp.json()
    assert len(control.calls) == calls  # none reached the engine


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
    server = AdminServer(FakeControl(), BOUND, 0, KEY).start()
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
    assert (cfg.admin_api_port, cfg.admin_api_host, cfg.admin_api_key) == (0, "127.0.0.1", "auto")
    assert (cfg.admin_api_file_dirs, cfg.admin_api_dynamic_modules) == ((), ())
    assert cfg.admin_storage_switch == "live"
    assert HiCacheConfig.from_extra_config(
        {"admin_api_port": 8100, "admin_storage_switch": "idle"}).admin_storage_switch == "idle"
    assert HiCacheConfig.from_extra_config({"admin_api_key": "none"}).admin_api_key == ""
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY + "\n")
    cfg = HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "0.0.0.0",
                                           "admin_api_key": f"@{key_file}"})
    assert cfg.admin_api_key == KEY and KEY not in repr(cfg)
    HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "0.0.0.0"})  # auto
    with pytest.raises(ValueError, match="admin_api_key is 'none'"):
        HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "0.0.0.0",
                                         "admin_api_key": "none"})
    HiCacheConfig.from_extra_config({"admin_api_port": 8100, "admin_api_host": "::1",
                                     "admin_api_key": "none"})
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    cfg = HiCacheConfig.from_extra_config({
        "admin_api_port": 8100, "admin_api_key_dir": str(tmp_path),
        "admin_api_file_dirs": [str(tmp_path / "link")],
        "admin_api_dynamic_modules": ["my_pkg.my_backend"]})
    assert cfg.admin_api_file_dirs == (str(tmp_path / "real"),)  # real paths, as files are
    assert cfg.admin_api_dynamic_modules == ("my_pkg.my_backend",)
    assert cfg.admin_api_key_dir == str(tmp_path)
    for bad, match in (
            ({"admin_api_port": 70000}, "admin_api_port"), ({"admin_api_port": "80"}, "port"),
            ({"admin_api_host": ""}, "admin_api_host"), ({"admin_api_key": "short"}, "key given"),
            ({"admin_api_key": ""}, "expected 'auto', 'none'"),
            ({"admin_api_key": f"@{tmp_path / 'missing'}"}, "admin_api_key=.*No such file"),
            ({"admin_api_key": "@/dev/zero"}, "admin_api_key=.*not a regular file"),
            ({"admin_api_port": 1, "admin_api_key_dir": "rel/dir"}, "absolute directory"),
            ({"admin_api_port": 1, "admin_api_key_dir": "/k", "admin_api_key": KEY},
             "admin_api_key_dir is where"),
            ({"admin_api_port": 1, "admin_api_file_dirs": "/etc/hicache"}, "expected a list"),
            ({"admin_api_port": 1, "admin_api_file_dirs": ["etc"]}, "absolute directory"),
            ({"admin_api_port": 1, "admin_api_file_dirs": ["/", "/etc"]}, "any file"),
            ({"admin_api_port": 1, "admin_api_dynamic_modules": ["a b"]}, "module names"),
            ({"admin_api_port": 1, "admin_api_dynamic_modules": "pkg"}, "module names"),
            ({"admin_api_file_dirs": ["/etc/hicache"]}, "admin API is off"),
            ({"admin_api_port": 1, "admin_storage_switch": "never"}, "admin_storage_switch"),
            ({"admin_storage_switch": "idle"}, "admin_storage_switch set but the admin API")):
        with pytest.raises(ValueError, match=match):
            HiCacheConfig.from_extra_config(bad)


# --- the generated key ---------------------------------------------------------------


def _get(url: str, key: str | None) -> tuple[int, dict]:
    headers = auth(key) if key is not None else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_generated_key_file(tmp_path):
    """admin_api_key="auto": a fresh key per start in a 0600 file of a 0700
    directory, required by every call, removed at stop."""
    key_file = tmp_path / "keys" / "admin-api-1.key"
    keys = []
    for _ in range(2):
        server = AdminServer(FakeControl(), BOUND, 0, key_file=key_file).start()
        try:
            key = key_file.read_text().strip()
            assert len(key) >= 40 and key_file.read_text() == key + "\n"
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
            assert _get(server.url, None)[0] == 401
            assert _get(server.url, key) == (200, {"kind": "get"})
            keys.append(key)
        finally:
            server.stop()
        assert not key_file.exists()
    assert keys[0] != keys[1]


def test_key_dir_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    server = AdminServer(FakeControl(), BOUND, 0, key_file=shared / "k.key")
    with pytest.raises(ValueError, match="admin_api_key_dir .* no one else can write"):
        server.start()
    assert not (shared / "k.key").exists()


def test_default_key_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert admin_key_file("", 8001) == tmp_path / "vllm_hicache" / "admin-api-8001.key"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert admin_key_file("", 8002) == tmp_path / "home/.cache/vllm_hicache/admin-api-8002.key"
    assert admin_key_file("/run/k", 8003) == tmp_path.root / __import__("pathlib").Path(
        "run/k/admin-api-8003.key")


# --- cross-site requests and DNS rebinding -------------------------------------------


@pytest.mark.parametrize("key", [KEY, ""])
def test_cross_site_content_types_are_refused(key):
    """What a page of another site can send without a preflight (text/plain,
    a form) is refused before the key or the body, keyless or not."""
    http, control = client(key=key)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  None):
        headers = {**auth(key), **({"Content-Type": ctype} if ctype else {})}
        for method, path in [("POST", PATH + "/clear"), ("POST", "/set_hicache_storage_backend"),
                             ("PUT", PATH)]:
            resp = http.request(method, path, headers=headers,
                                content=b'{"storage_backend": null}')
            assert resp.status_code == 415, (method, path, ctype, resp.text)
            assert resp.json()["field"] == "Content-Type"
            assert "application/json" in resp.json()["error"]
    resp = http.delete(PATH, headers={**auth(key), "Content-Type": "text/plain"})
    assert resp.status_code == 415
    assert control.calls == []
    assert http.delete(PATH, headers=auth(key)).status_code == 200  # body-less: no type needed
    resp = http.post(PATH + "/clear", headers={**auth(key),
                                                "Content-Type": "Application/JSON; charset=utf-8"})
    assert resp.status_code == 200
    assert [kind for kind, _ in control.calls] == ["detach", "clear"]


@pytest.mark.parametrize("key", [KEY, ""])
def test_foreign_host_or_origin_is_refused(key):
    """DNS rebinding (a foreign Host) and cross-site calls (a foreign Origin)
    get 403 on every route, with or without the key."""
    http, control = client(key=key)
    for headers in ({"Host": "evil.example"}, {"Host": f"evil.example:{PORT}"},
                    {"Host": f"127.0.0.1:{PORT + 1}"}, {"Host": f"[::1]:{PORT}"},
                    {"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Origin": f"https://127.0.0.1:{PORT}"}):
        for method, path in [("GET", PATH), ("DELETE", PATH), ("POST", PATH + "/clear"),
                             ("PUT", PATH)]:
            resp = http.request(method, path, headers={**auth_json(key), **headers},
                                json={"backend": "file"})
            assert resp.status_code == 403, (headers, method, resp.text)
            assert resp.json()["field"] == next(iter(headers)), resp.json()
    assert control.calls == []
    for headers in ({"Host": f"localhost:{PORT}"}, {"Origin": f"http://127.0.0.1:{PORT}"},
                    {"Host": f"LOCALHOST:{PORT}", "Origin": f"http://localhost:{PORT}"}):
        assert http.get(PATH, headers={**auth(key), **headers}).status_code == 200, headers


def test_host_names_follow_the_bound_address():
    http, _ = client(host="::1")
    assert http.get(PATH, headers=auth()).status_code == 200  # [::1]:PORT
    assert http.get(PATH, headers={**auth(), "Host": f"127.0.0.1:{PORT}"}).status_code == 403
    http, _ = client(host="localhost")
    for host in ("localhost", "127.0.0.1", "[::1]"):
        assert http.get(PATH, headers={**auth(), "Host": f"{host}:{PORT}"}).status_code == 200
    # Off loopback the key is required (config) and any name of the host may be used;
    # a browser's Origin must still match the Host it used.
    http, _ = client(host="0.0.0.0")
    assert http.get(PATH, headers={**auth(), "Host": f"gpu-7.internal:{PORT}"}).status_code == 200
    assert http.get(PATH, headers={**auth(), "Host": f"gpu-7.internal:{PORT}",
                                   "Origin": "http://evil.example"}).status_code == 403


# --- request bodies -------------------------------------------------------------------


def _raw_call(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_body_limit_is_checked_before_reading():
    """A Content-Length over the limit is answered 413 at once (the body is
    never waited for); without one, reading stops one chunk past the limit."""
    server = AdminServer(FakeControl(), BOUND, 0, KEY).start()
    try:
        head = (f"PUT {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n")
        start = time.monotonic()
        answer = _raw_call(server.port, (head + "Content-Length: 1000000000\r\n\r\n").encode())
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert f"larger than {MAX_BODY_BYTES} bytes".encode() in answer
        assert time.monotonic() - start < 5
        chunk = b"[" * 8192
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10)) + b"0\r\n\r\n"
        answer = _raw_call(server.port, (head + "Transfer-Encoding: chunked\r\n\r\n").encode(),
                           chunked)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert server.control.calls == []
    finally:
        server.stop()


def test_deep_json_is_400_not_a_recursion_error():
    http, control = client()
    # 60,000 deep fits the size limit unclosed; the parser would recurse on it.
    for body in (b"[" * 60_000, b'{"a":' * 12_000, b"[" * 33 + b"]" * 33):
        resp = http.put(PATH, headers=auth_json(), content=body)
        assert resp.status_code == 400, resp.text[:200]
        assert resp.json() == {"error": "JSON nested deeper than 32 levels", "field": "body"}
    # Brackets inside strings are text, not nesting.
    resp = http.put(PATH, headers=auth_json(), json={
        "backend": "file", "extra_config": {"path": "/l3/" + "[{" * 100}})
    assert resp.status_code == 200, resp.text
    assert control.calls[0][0] == "attach"


# --- what a body may name: files and modules --------------------------------------------


def _refusal(body, policy: AdminPolicy | None = None) -> BodyError:
    with pytest.raises(BodyError) as err:
        parse_attach(body, policy=policy or AdminPolicy())
    return err.value


def test_options_name_no_file_outside_the_allowed_dirs(tmp_path):
    """@/path anywhere in the options (the Redis password, storage_secret,
    nested) and *_file options are refused unless the real path is inside
    admin_api_file_dirs; the answer is the same whether the file exists."""
    secret_file = tmp_path / "outside" / "id_ed25519"
    secret_file.parent.mkdir()
    secret_file.write_text("PRIVATE KEY MATERIAL 0123456789\n")
    missing = tmp_path / "outside" / "no-such-file"
    redis = {"url": "redis://127.0.0.1:6399"}
    for extra, where in [
            ({**redis, "password": "@{f}"}, "password"),
            ({**redis, "tls_ca_file": "{f}"}, "tls_ca_file"),
            ({"path": "/l3", "storage_secret": "@{f}"}, "storage_secret"),
            ({"path": "/l3", "params": {"list": [1, "@{f}"]}}, "params.list[1]")]:
        answers = []
        for path in (secret_file, missing):
            body = {"backend": "redis" if "url" in extra else "file",
                    "extra_config": json.loads(json.dumps(extra).replace("{f}", str(path)))}
            err = _refusal(body)
            assert err.field == "extra_config"
            assert str(err).startswith(f"option {where} names a file; the admin API reads only")
            assert "none are set" in str(err)
            answers.append(str(err))
        assert answers[0] == answers[1]  # nothing says whether the file exists
    legacy = {"storage_backend": "redis", "hicache_storage_backend_extra_config_json":
              json.dumps({**redis, "password": f"@{secret_file}"})}
    with pytest.raises(BodyError) as err:
        parse_attach(legacy, legacy=True)
    assert err.value.field == "hicache_storage_backend_extra_config_json"


def test_allowed_dirs_are_checked_on_real_paths(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    secret_file = allowed / "l3.secret"
    secret_file.write_text("s" * 32 + "\n")
    outside = tmp_path / "outside.secret"
    outside.write_text("o" * 32 + "\n")
    (allowed / "link").symlink_to(outside)
    (allowed / "zero").symlink_to("/dev/zero")
    os.mkfifo(allowed / "fifo")
    policy = AdminPolicy(file_dirs=(str(allowed),))
    spec = parse_attach({"backend": "file", "extra_config": {
        "path": "/l3", "storage_secret": f"@{secret_file}"}}, policy=policy)
    assert spec.storage.secret is not None
    for path in (allowed / "link", allowed / ".." / "outside.secret", allowed / "zero", outside):
        err = _refusal({"backend": "file", "extra_config": {"storage_secret": f"@{path}"}}, policy)
        assert "this one is not inside one of them" in str(err)
    start = time.monotonic()  # inside the allowed directory: read, but never waited on
    err = _refusal({"backend": "file", "extra_config": {"storage_secret": f"@{allowed}/fifo"}},
                   policy)
    assert "not a regular file" in str(err) and time.monotonic() - start < 5


def test_dynamic_backend_imports_only_allowed_modules(tmp_path, monkeypatch):
    """Backend "dynamic" names a module_path of admin_api_dynamic_modules or
    is refused; a refused module is never imported."""
    marker = tmp_path / "imported"
    (tmp_path / "hicache_import_canary.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    body = {"backend": "dynamic", "extra_config": {"module_path": "hicache_import_canary",
                                                   "class_name": "Backend"}}
    for policy in (AdminPolicy(), AdminPolicy(dynamic_modules=("other_pkg.backend",))):
        err = _refusal(body, policy)
        assert err.field == "extra_config" and "admin_api_dynamic_modules" in str(err)
    http, control = client(policy=AdminPolicy())
    resp = http.put(PATH, headers=auth_json(), json=body)
    assert resp.status_code == 400 and "admin_api_dynamic_modules" in resp.json()["error"]
    assert control.calls == []
    assert not marker.exists() and "hicache_import_canary" not in sys.modules
    allowed = AdminPolicy(dynamic_modules=("hicache_import_canary",))
    assert parse_attach(body, policy=allowed).backend == "dynamic"
