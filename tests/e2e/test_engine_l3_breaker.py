"""The L3 circuit breaker on a real engine, for each way a store fails
mid-run: Redis killed (then restarted, empty), a file store whose directory
starts failing every operation (then repaired), a user backend that starts
sleeping 2 s per call (then recovers). In each: the breaker trips within its
configured time, requests keep their greedy answers and are served from
L1/L2 without touching the store, and once the store is healthy HiCache
resumes on its own: what is computed (or was stored) is hit in L3 again.

Short settings (window 1 s, budget 300 ms, probe every 0.2 s) keep each test
short; the bounds below add slack for a busy CI machine."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.engine_utils import (
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    settle_backups,
)
from tests.storage.redis.services import RedisServer

pytestmark = pytest.mark.engine

WINDOW_S, BUDGET_MS, PROBE_S = 1.0, 300, 0.2
# Scheduling noise on a loaded machine, on top of each bound.
SLACK_S = 5.0
FRESH = [[5 + (i * 11) % 470 for i in range(100)], [9 + (i * 13) % 470 for i in range(130)]]


def l3_extra(backend: str, options: dict) -> dict:
    return {
        "hicache_io_backend": "direct",
        "hicache_storage_backend": backend,
        "hicache_storage_prefetch_policy": "timeout",
        "hicache_storage_backend_extra_config": {
            **options, "prefetch_threshold": 32, "prefetch_timeout_base": 1.0,
            "prefetch_timeout_per_ki_token": 0.0,
        },
        "l3_breaker_window_s": WINDOW_S,
        "l3_breaker_latency_budget_ms": BUDGET_MS,
        "l3_breaker_probe_interval_s": PROBE_S,
    }


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.1f} s")
        time.sleep(0.02)
    return time.monotonic() - start


def hits_l3(llm, prompts: list[list[int]], expected: list[list[int]]) -> list[int]:
    """Serve ``prompts`` from L3 alone (L1 and L2 dropped): their answers
    are ``expected``; the tokens each got cached."""
    half = scheduler_half(llm)
    before = half.l3.prefetched_blocks
    assert llm.reset_prefix_cache(reset_connector=True)
    outputs, cached = generate(llm, prompts)
    assert outputs == expected
    assert half.l3.prefetched_blocks > before, "nothing was read from L3"
    return cached


def run_outage(llm, reference, fail: Callable[[], None], heal: Callable[[], None],
               heal_s: float, keeps_data: bool) -> None:
    half = scheduler_half(llm)
    planner = half.l3
    prompts = prompts_with_shared_prefix()
    outputs, _ = generate(llm, prompts)
    assert outputs == reference
    settle_backups(llm)
    assert planner.health.usable and planner.breaker_status()["state"] == "closed"

    fail()
    took_s = wait_for(lambda: not planner.health.usable,
                      WINDOW_S + BUDGET_MS / 1e3 + PROBE_S + SLACK_S, "the breaker trips")
    assert took_s >= WINDOW_S * 0.9, f"tripped after {took_s:.2f} s, before the window"
    status = planner.breaker_status()
    assert status["state"] in ("tripped", "probing") and status["trips"] == 1
    assert status["last_failure"]

    # Tripped: L2 dropped, so only vLLM's own cache hits (the 64-token
    # shared prefix, for 2 of the 3 requests); the store is not asked.
    assert llm.reset_prefix_cache(reset_connector=True)
    outputs, cached = generate(llm, prompts)
    assert outputs == reference
    assert sorted(cached) == [0, 64, 64]
    assert planner.breaker_skipped_lookups > 0 and planner.backups.breaker_skipped_blocks > 0

    heal()
    wait_for(lambda: planner.health.usable, heal_s + PROBE_S + SLACK_S, "the breaker closes")
    generate(llm, [[7] * 3])  # a step: the scheduler reads the breaker
    assert planner.usable and planner.breaker_status()["trips"] == 1
    if keeps_data:  # what was stored before the failure is hit again
        assert sum(hits_l3(llm, prompts, reference)) > 128
    # What is computed from now on is backed up and hit again.
    cold, _ = generate(llm, FRESH)
    settle_backups(llm)
    assert hits_l3(llm, FRESH, cold) == [96, 128]
    half.check_integrity()


def test_redis_killed_then_restarted(tiny_model_dir, reference, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    llm = make_llm(tiny_model_dir, l3_extra("redis", {"url": server.url,
                                                      "socket_timeout_s": 0.5}))
    try:
        run_outage(llm, reference, fail=server.kill, heal=server.start, heal_s=1.0,
                   keeps_data=False)  # no persistence: it restarts empty
    finally:
        close(llm)
        server.kill()


class BrokenDir:
    """Makes every operation of a file store fail, as root too (permissions
    would not stop root): each of the 256 top-level directory names becomes
    a regular file, the directories moved aside; ``repair`` puts them back."""

    def __init__(self, root: Path, aside: Path) -> None:
        self.root, self.aside = root, aside

    def _names(self) -> list[str]:
        return [f"{i:02x}" for i in range(256)]

    def break_(self) -> None:
        self.aside.mkdir()
        for name in self._names():
            path = self.root / name
            for _ in range(100):  # a put may make the directory again meanwhile
                if path.is_dir():
                    path.rename(self.aside / f"{name}.{len(list(self.aside.glob(name + '*')))}")
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                    break
                except (FileExistsError, IsADirectoryError):
                    continue

    def repair(self) -> None:
        for name in self._names():
            (self.root / name).unlink()
            moved = sorted(self.aside.glob(name + ".*"))
            if moved:
                moved[0].rename(self.root / name)  # the first: the objects stored before


def test_file_store_directory_fails_then_is_repaired(tiny_model_dir, reference, tmp_path):
    root = tmp_path / "l3"
    broken = BrokenDir(root, tmp_path / "aside")
    llm = make_llm(tiny_model_dir, l3_extra("file", {"path": str(root)}))
    try:
        run_outage(llm, reference, fail=broken.break_, heal=broken.repair, heal_s=1.0,
                   keeps_data=True)
    finally:
        close(llm)


def test_dynamic_backend_sleeping_2s_per_call_then_fast_again(tiny_model_dir, reference,
                                                              tmp_path):
    flag = tmp_path / "sleep"
    llm = make_llm(tiny_model_dir, l3_extra("dynamic", {
        "module_path": "tests.storage.user_backend", "class_name": "SleepyBackend",
        "persist_dir": str(tmp_path / "objects"), "sleep_flag": str(flag), "sleep_s": 2.0,
    }))
    try:
        run_outage(llm, reference, fail=flag.touch, heal=flag.unlink,
                   heal_s=2.0,  # a probe asleep when it heals fails; the next one passes
                   keeps_data=True)
    finally:
        close(llm)
