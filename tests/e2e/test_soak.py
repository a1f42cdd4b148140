"""Soak (behind a flag): thousands of requests through a real engine with
shared prefixes, random aborts mid-load and mid-backup, and an L3 that
stalls and recovers. Afterwards pinned pages, in-flight operations and the
process's memory must be back at their baseline; the RSS curve is printed
(and written to ``$HICACHE_SOAK_REPORT`` when set).

Run: ``make soak`` (``HICACHE_SOAK=1``, 3000 requests; it also runs the same
traffic through vLLM alone first, and the growth of RSS over the second half
of the run, beyond vLLM's own, must stay under 32 MiB). In ``make test`` a
short version runs: 200 requests, every phase once, every check but memory.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from tests.e2e.engine_utils import KV_BYTES, close, make_llm, scheduler_half
from tests.storage import user_backend

pytestmark = pytest.mark.engine

SOAK = os.getenv("HICACHE_SOAK") == "1"
NUM_REQUESTS = int(os.getenv("HICACHE_SOAK_REQUESTS", "3000" if SOAK else "200"))
# Requests in flight at once, and the engine steps allowed per request.
CONCURRENCY = 12
MAX_STEPS_PER_REQUEST = 40


def rss_bytes() -> int:
    """This process's resident memory, less the in-process L3's objects
    (they are the store's, not a leak of ours)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 - StallingBackend.stored_bytes()
    raise RuntimeError("no VmRSS in /proc/self/status")


class Stall:
    """While set, every L3 put and get of the stalling backend waits (up to
    ``max_s``), as a store that stops answering and comes back does."""

    def __init__(self, max_s: float) -> None:
        self.active = threading.Event()
        self.max_s = max_s

    def wait_if_stalled(self) -> None:
        deadline = time.monotonic() + self.max_s
        while self.active.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)


STALL = Stall(max_s=2.0)


# One store for the scheduler's and the worker's backend instances.
_OBJECTS: dict[str, bytes] = {}
_OBJECTS_LOCK = threading.Lock()


class StallingBackend(user_backend.MemoryBackend):
    name = "stalling"

    def __init__(self, options, ctx) -> None:
        super().__init__(options, ctx)
        self._objects, self._lock = _OBJECTS, _OBJECTS_LOCK

    @staticmethod
    def stored_bytes() -> int:
        with _OBJECTS_LOCK:
            return sum(len(v) for v in _OBJECTS.values())

    def put(self, keys, sources):
        STALL.wait_if_stalled()
        return super().put(keys, sources)

    def get(self, keys, targets):
        STALL.wait_if_stalled()
        return super().get(keys, targets)


def soak_prompt(rng: random.Random, prefixes: list[list[int]],
                history: list[list[int]]) -> list[int]:
    if history and rng.random() < 0.3:
        return rng.choice(history)  # a conversation comes back: L2 or L3
    base = rng.choice(prefixes)[: rng.choice((32, 64, 96, 128))]
    history.append(base + [rng.randrange(3, 470) for _ in range(rng.randint(5, 90))])
    return history[-1]


SOAK_EXTRA = {
    "hicache_io_backend": "direct",
    "hicache_ratio": 2,
    "hicache_load_mode": "async",
    "hicache_storage_backend": "dynamic",
    "hicache_storage_prefetch_policy": "timeout",
    "hicache_storage_backend_extra_config": {
        "module_path": __name__, "class_name": "StallingBackend",
        "prefetch_threshold": 32, "prefetch_timeout_base": 0.2,
        "prefetch_timeout_per_ki_token": 0.0, "prefetch_timeout_max": 0.5,
    },
}


def soak_engine(model_dir, connector: bool):
    return make_llm(model_dir, SOAK_EXTRA, connector=connector, max_num_seqs=8,
                    kv_bytes=KV_BYTES // 2, max_model_len=320)


def drive(llm, half=None) -> list[tuple[int, int]]:
    """Seeded traffic: arrivals, aborts, L3 stalls, L1 resets. Returns the
    RSS curve (requests done, bytes); checks ``half`` as it goes."""
    from vllm import SamplingParams

    rng = random.Random(0)
    prefixes = [[3 + (i * k * 31) % 470 for i in range(128)] for k in range(1, 9)]
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    curve: list[tuple[int, int]] = []
    live: set[str] = set()
    history: list[list[int]] = []
    submitted = done = steps = 0
    while done < NUM_REQUESTS:
        assert steps < NUM_REQUESTS * MAX_STEPS_PER_REQUEST, "the soak stopped making progress"
        while len(live) < CONCURRENCY and submitted < NUM_REQUESTS:
            req_id = f"s{submitted}"
            prompt = {"prompt_token_ids": soak_prompt(rng, prefixes, history)}
            engine.add_request(req_id, prompt, sp)
            live.add(req_id)
            submitted += 1
        if live and rng.random() < 0.05:  # mid-load, mid-prefetch or mid-decode
            victim = rng.choice(sorted(live))
            engine.abort_request([victim])
            live.discard(victim)
            done += 1
        # The store stops answering for a tenth of the run, then comes back.
        if (submitted * 10 // NUM_REQUESTS) % 4 == 2:
            STALL.active.set()
        else:
            STALL.active.clear()
        if rng.random() < 0.01:
            llm.reset_prefix_cache()  # L1 forgets: hits must come from L2/L3
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.discard(out.request_id)
                done += 1
        steps += 1
        if steps % 50 == 0:
            if half is not None:
                half.check_integrity()
            curve.append((done, rss_bytes()))
    STALL.active.clear()
    curve.append((done, rss_bytes()))
    return curve


def growth_after_warmup(curve: list[tuple[int, int]]) -> int:
    """RSS growth over the second half of the run (the first is warm-up:
    allocator arenas, vLLM's per-shape caches, the pool's first touch)."""
    half_way = next(rss for n, rss in curve if n >= NUM_REQUESTS // 2)
    return curve[-1][1] - half_way


def test_soak_returns_to_baseline(tiny_model_dir):
    baseline = None
    if SOAK:  # vLLM alone, same traffic: what growth is vLLM's own
        llm = soak_engine(tiny_model_dir, connector=False)
        try:
            baseline = drive(llm)
        finally:
            close(llm)
    llm = soak_engine(tiny_model_dir, connector=True)
    half = scheduler_half(llm)
    try:
        curve = drive(llm, half)
        drain_idle(llm.llm_engine, half)
        half.check_integrity()
        # Pins, operations, prefetch pages: all back to zero.
        assert len(half.ops) == 0 and half.tree.num_locked_pages == 0
        assert not half.tree.allocated_pages() and not half.l3.in_flight()["prefetches"]
        assert half.stats.loaded_blocks > 0 and half.l3.prefetched_blocks > 0
        report(curve, baseline)
        if baseline is not None:
            extra_growth = growth_after_warmup(curve) - growth_after_warmup(baseline)
            assert extra_growth < 32 << 20, (extra_growth, curve, baseline)
    finally:
        STALL.active.clear()
        close(llm)


def drain_idle(engine, half, timeout_s: float = 30.0) -> None:
    """Step an idle engine until the connector has nothing pending, as
    vLLM's busy loop does while ``has_requests()``."""
    deadline = time.monotonic() + timeout_s
    sched = engine.engine_core.engine_core.scheduler
    while sched.has_requests() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)
    engine.step()  # acknowledges the last step's stores
    assert not sched.has_requests(), "pending work never drained"


def report(curve, baseline=None) -> None:
    """Print (and write to $HICACHE_SOAK_REPORT) each RSS curve."""
    rows = ["system requests_done rss_mib"]
    for system, points in (("hicache", curve), ("vllm_alone", baseline or [])):
        rows += [f"{system} {n} {rss / 2**20:.1f}" for n, rss in points]
    text = "\n".join(rows)
    print("\nRSS curves:\n" + text)
    path = os.getenv("HICACHE_SOAK_REPORT")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
