"""Attach, replace, clear and detach the L3 of a real ``vllm-hicache serve``
while a stream of requests runs (admin_storage_switch=live, the default).

The server starts with no L3 and computes the greedy answers of its prompts
(the reference). Then three clients send those prompts, at random, without
pause, while the admin API makes 36 calls at seeded random moments: attach a
file backend, replace it with a file backend in another directory, replace
that with Redis, clear, detach, GET, and a few bad bodies, with
``pending_backups`` finish, drop or move at random. Every request must
succeed with its reference answer; every call must answer 200 (400 for the
bad bodies), a switch within its stated bound (docs/admin-api.md: two steps
after the call is taken). Finally, with Redis attached, a prompt computed
after the switch comes back from Redis once L1 and L2 are dropped.

Bounded: at most ``MAX_REQUESTS`` requests and ``RUN_S`` seconds of load.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.test_admin_api import KEY, Admin
from tests.e2e.test_serve import BLOCK, CLI, TEST_ARGS, Server, _cores
from tests.ports import free_ports
from tests.storage.redis.services import RedisServer

pytestmark = pytest.mark.engine

SEED = 24
NUM_CALLS = 36
NUM_CLIENTS = 3
MAX_REQUESTS = 3000
RUN_S = 300.0
# Starting takes minutes on a machine whose cores other jobs share.
START_S = 600.0
MAX_TOKENS = 8
# The stated bound of a switch, in engine steps after the call is taken.
SWITCH_STEPS = 2
# 24 prompts of six blocks: more than L2 holds (64 pages), so L3 is used.
PROMPTS = [[5 + (i * (7 + 2 * k) + k * 13) % 460 for i in range(6 * BLOCK)] + [k + 3] * 10
           for k in range(24)]
AFTER = [19 + (i * 23) % 450 for i in range(5 * BLOCK)]  # only after the last switch


def _complete(url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as resp:
        out = json.loads(resp.read())
    return {"token_ids": out["choices"][0]["token_ids"],
            "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"]}


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    if not CLI.exists():
        pytest.fail(f"{CLI} is missing: run `pip install -e . --no-deps` (or `make setup`)")
    tmp = tmp_path_factory.mktemp("live")
    redis = RedisServer(tmp / "redis").start()
    api_port, admin_port = free_ports(2)
    extra = {"admin_api_port": admin_port, "admin_api_key": KEY}
    config = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
    argv = [str(CLI), "serve", str(tiny_model_dir), "--kv-transfer-config", json.dumps(config),
            *TEST_ARGS]
    server = Server("live", argv, tmp / "server.log", _cores()[-1], api_port)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's /reset_prefix_cache
        server.start()
    try:
        server.wait_ready(START_S)
        yield Admin(server, admin_port), tmp, redis
        log = server.log()
        assert "Traceback" not in log, log[-4000:]
    finally:
        server.stop()
        redis.kill()


def _bodies(tmp, redis: RedisServer) -> dict[str, dict]:
    def file(name: str) -> dict:
        return {"backend": "file", "prefetch_policy": "wait_complete", "extra_config": {
            "path": str(tmp / name), "prefetch_threshold": BLOCK}}

    return {"file_a": file("l3-a"), "file_b": file("l3-b"),
            "redis": {"backend": "redis", "prefetch_policy": "timeout", "extra_config": {
                "url": redis.url, "prefetch_threshold": BLOCK}}}


def _schedule(rng: random.Random) -> list[str]:
    """NUM_CALLS calls: cycles of attach A, replace by B, replace by Redis,
    clear, detach, with GETs and bad bodies at random places."""
    cycle = ["file_a", "file_b", "redis", "clear", "detach"]
    calls: list[str] = []
    while len(calls) < NUM_CALLS:
        for name in cycle:
            calls.append(name)
            if rng.random() < 0.25:
                calls.append(rng.choice(["get", "bad"]))
    return calls[:NUM_CALLS]


class Load:
    """NUM_CLIENTS threads sending PROMPTS at random until stopped."""

    def __init__(self, url: str, reference: list[list[int]], seed: int) -> None:
        self.url = url
        self.reference = reference
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = 0
        self.failures: list[str] = []
        self.changed: list[int] = []
        self.threads = [threading.Thread(target=self._client, args=(random.Random(seed + i),),
                                         daemon=True) for i in range(NUM_CLIENTS)]

    def _client(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            with self.lock:
                if self.done >= MAX_REQUESTS:
                    return
            k = rng.randrange(len(PROMPTS))
            try:
                got = _complete(self.url, PROMPTS[k])["token_ids"]
            except (OSError, ValueError, KeyError) as err:
                with self.lock:
                    self.failures.append(repr(err))
                continue
            with self.lock:
                self.done += 1
                if got != self.reference[k]:
                    self.changed.append(k)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def test_switches_under_load_fail_no_request_and_change_no_answer(live):
    admin, tmp, redis = live
    assert admin.get()["backend"] is None  # started without L3
    reference = [_complete(admin.server.url, p)["token_ids"] for p in PROMPTS]
    bodies = _bodies(tmp, redis)
    rng = random.Random(SEED)
    attached: str | None = None
    calls: list[tuple[str, int, dict]] = []
    started = time.monotonic()
    with Load(admin.server.url, reference, SEED) as load:
        for name in _schedule(rng):
            time.sleep(rng.uniform(0.05, 1.0))
            assert time.monotonic() - started < RUN_S, "the run took too long"
            if name == "get":
                status, body = admin.call("GET")
            elif name == "bad":
                status, body = admin.call("PUT", body={"backend": "file", "pending_backups":
                                                       "later"})
                assert status == 400 and body["field"] == "pending_backups", body
                calls.append((name, status, body))
                continue
            elif name == "clear":
                status, body = admin.call("POST", "/hicache/storage-backend/clear")
            elif name == "detach":
                mode = rng.choice(["finish", "drop"])
                status, body = admin.call("DELETE", body={"pending_backups": mode})
            else:
                mode = rng.choice(["finish", "drop", "move"] if attached else ["finish", "drop"])
                status, body = admin.call("PUT", body={**bodies[name], "pending_backups": mode})
            calls.append((name, status, body))
            assert status == 200, (name, body)
            if name in bodies:
                attached = name
                assert body["message"] in ("attached", "replaced"), body
                assert body["backend"] == bodies[name]["backend"]
                assert body["switch"]["steps"] <= SWITCH_STEPS, body["switch"]
            elif name == "detach":
                attached = None
                assert body["state"] == "detached" and body["switch"]["steps"] == 0, body
        served_during = load.done
    assert len(calls) == NUM_CALLS
    assert not load.failures, load.failures[:5]
    assert not load.changed, f"{len(load.changed)} answers changed (prompts {load.changed[:8]})"
    assert served_during >= NUM_CALLS, served_during  # requests ran throughout

    # The last switch: Redis holds what is computed after it. The request
    # waits for its prefetch (under the timeout policy a loaded machine
    # recomputed it: seen, cached 0), so a miss means Redis lacked it.
    status, body = admin.call("PUT", body={**bodies["redis"], "pending_backups": "finish",
                                           "prefetch_policy": "wait_complete"})
    assert status == 200, body
    first = _complete(admin.server.url, AFTER)
    admin.wait_idle()
    admin.reset(external=True)  # L1 and L2
    again = _complete(admin.server.url, AFTER)
    assert again["token_ids"] == first["token_ids"]
    assert again["cached"] >= (len(AFTER) // BLOCK - 1) * BLOCK, (again, admin.get())
    final = admin.get()
    assert final["backend"] == "redis" and final["l3_stats"]["prefetched_blocks"] > 0
    assert final["retiring"] == []  # every old backend closed
    status, body = admin.call("DELETE")
    assert status == 200 and body["state"] == "detached"
