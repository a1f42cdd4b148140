"""Randomized, model-based stress test of the scheduler half on vLLM's real
Scheduler (tests/connector/harness.py: our worker half, a fake forward that
writes KV derived from each block's hash).

Each seed picks an eviction policy, a write policy, a load mode and whether
an L3 (slow, failing at random) is attached, then drives seeded random
traffic: arrivals sharing prefixes, chunked prefill, a tiny L1 (preemptions)
and L2 (eviction pressure), aborts (also mid-load and mid-backup), L1 resets,
and worker acknowledgements that arrive late, out of order, and from two
simulated ranks that disagree on progress. After every step the whole
scheduler half must pass ``check_integrity()`` and every loaded block must
hold exactly the bytes computed for it. At the end, with traffic stopped and
every held acknowledgement delivered, every pin must be gone.

``HICACHE_STRESS_STEPS`` (default 500 per seed) and ``HICACHE_STRESS_SEEDS``
(default 12) make it a soak.
"""

from __future__ import annotations

import os
import random
import uuid

import pytest
from vllm.v1.request import RequestStatus

from tests.connector.harness import BLOCK, make_harness
from vllm_hicache.common.jobs import PrefetchProgress
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.policy import EVICTION_POLICIES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS = int(os.getenv("HICACHE_STRESS_STEPS", "500"))
SEEDS = int(os.getenv("HICACHE_STRESS_SEEDS", "12"))
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LOAD_MODES = ("layerwise", "async")


def case(seed: int) -> dict:
    """Every value of every option appears across the default seeds."""
    return dict(
        radix_eviction_policy=EVICTION_POLICIES[seed % len(EVICTION_POLICIES)],
        hicache_write_policy=WRITE_POLICIES[seed % len(WRITE_POLICIES)],
        hicache_load_mode=LOAD_MODES[(seed // 2) % len(LOAD_MODES)],
        l3=seed % 4 != 3,
        prefetch_policy=("best_effort", "wait_complete", "timeout")[(seed // 4) % 3],
        copy_failures=seed % 4 != 2,
    )


def same_step(opts: dict) -> dict:
    """Same-step admission (l3/same_step.py) wherever it is accepted:
    synchronous loads under a policy that waits."""
    if opts["hicache_load_mode"] == "layerwise" and opts["prefetch_policy"] != "best_effort":
        return {"same_step_read_wait_ms": 50.0}
    return {}


class AckMixer:
    """Stands between the worker and the scheduler: holds acknowledgements
    back for random numbers of steps, lets them out in random order across
    operations (in order per operation and rank, as vLLM delivers them),
    and plays a second TP rank whose reports lag and differ from rank 0."""

    def __init__(self, rng: random.Random, release_rate: float) -> None:
        self.rng = rng
        self.release_rate = release_rate
        # (op kind, op id, rank) -> FIFO of payloads
        self.queues: dict[tuple[str, int, int], list] = {}
        self.draining = False

    def __call__(self, meta: HiCacheWorkerMetadata | None) -> HiCacheWorkerMetadata | None:
        if meta is not None:
            for op_id, by_rank in meta.prefetch.items():
                for rank, progress in by_rank.items():
                    done, finished = progress.done, progress.finished
                    self._hold(("prefetch", op_id, rank), progress)
                    lagging = done if finished else self.rng.randint(0, done)
                    self._hold(("prefetch", op_id, 1),
                               PrefetchProgress(lagging, False, progress.state_pages))
                    if finished:
                        self._hold(("prefetch", op_id, 1), progress)
            for op_id in meta.backups:
                self._hold(("backup", op_id, 0), None)
                self._hold(("backup", op_id, 1), None)
            failed = getattr(meta, "failed_store_pages", None)
        else:
            failed = None
        out = HiCacheWorkerMetadata()
        if failed:
            out.failed_store_pages = set(failed)
        for key in list(self.queues):
            if self.draining or self.rng.random() < self.release_rate:
                self._release(key, out)
        return out if (out.prefetch or out.backups or failed) else None

    def _hold(self, key, payload) -> None:
        self.queues.setdefault(key, []).append(payload)

    def _release(self, key, out: HiCacheWorkerMetadata) -> None:
        kind, op_id, rank = key
        payload = self.queues[key].pop(0)
        if not self.queues[key]:
            del self.queues[key]
        if kind == "prefetch":
            out.prefetch.setdefault(op_id, {})[rank] = payload
        else:
            out.backups.setdefault(op_id, set()).add(rank)


def build(tiny_model_dir, seed: int):
    opts = case(seed)
    extra = dict(
        radix_eviction_policy=opts["radix_eviction_policy"],
        hicache_write_policy=opts["hicache_write_policy"],
        hicache_load_mode=opts["hicache_load_mode"],
        hicache_ratio=2,
    )
    if opts["l3"]:
        extra.update(
            hicache_storage_backend="dynamic",
            hicache_storage_prefetch_policy=opts["prefetch_policy"],
            hicache_storage_backend_extra_config={
                "module_path": "tests.connector.mem_backend", "class_name": "FlakyMemBackend",
                "store": uuid.uuid4().hex, "fail_rate": 0.1, "delay_s": 0.0005, "seed": seed,
                "prefetch_threshold": BLOCK, "prefetch_timeout_max": 0.2,
                **same_step(opts),
            },
        )
    h = make_harness(tiny_model_dir, num_blocks=24, max_num_seqs=6, max_batched=96, **extra)
    # The configuration under test is the one we asked for (nothing rewritten).
    cfg = h.sched_half.cfg
    assert (cfg.radix_eviction_policy, cfg.hicache_write_policy, cfg.hicache_load_mode) == (
        opts["radix_eviction_policy"], opts["hicache_write_policy"], opts["hicache_load_mode"])
    assert (h.sched_half.l3 is not None) == opts["l3"]
    if opts["l3"]:
        h.sched_half.l3.world_size = 2  # the mixer plays rank 1
        # Slow acks on some seeds: backups pin L2 until stores run short.
        h.worker_meta_filter = AckMixer(random.Random(seed + 1000), (0.05, 0.35)[seed % 2])
    if opts["copy_failures"]:
        FlakyCopies.install(h.worker.worker, random.Random(seed + 2000))
    return h


class FlakyCopies:
    """Wraps the worker's transfer: a few copies (either way) raise, as a
    copy that hits a bad page or a CUDA error would."""

    RATE = 0.03

    def __init__(self, transfer, rng: random.Random) -> None:
        self._transfer, self._rng = transfer, rng
        self.failures = 0

    @classmethod
    def install(cls, worker, rng: random.Random) -> None:
        flaky = cls(worker.transfer, rng)
        worker.transfer = flaky  # the async loader's too

    def __getattr__(self, name):
        return getattr(self._transfer, name)

    def _maybe_fail(self) -> None:
        if self._rng.random() < self.RATE:
            self.failures += 1
            raise RuntimeError("injected copy failure")

    def load_layer(self, layer, block_ids, page_ids):
        self._maybe_fail()
        return self._transfer.load_layer(layer, block_ids, page_ids)

    def load(self, block_ids, page_ids):
        self._maybe_fail()
        return self._transfer.load(block_ids, page_ids)

    def store(self, block_ids, page_ids):
        self._maybe_fail()
        return self._transfer.store(block_ids, page_ids)


def random_prompt(rng: random.Random, prefixes: list[list[int]],
                  history: list[list[int]]) -> list[int]:
    if history and rng.random() < 0.3:
        # An old conversation comes back: long gone from L1, often from L2
        # too, so its blocks come from L3 (or are recomputed).
        return rng.choice(history)
    base = rng.choice(prefixes) if rng.random() < 0.8 else []
    tail = [rng.randrange(50, 450) for _ in range(rng.randint(1, 3 * BLOCK))]
    history.append(base + tail)
    return base + tail


def traffic_step(h, rng: random.Random, prefixes, next_id: list[int],
                 history: list[list[int]]) -> None:
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        next_id[0] += 1
        h.add(f"r{next_id[0]}", random_prompt(rng, prefixes, history),
              max_tokens=rng.randint(1, 6), priority=rng.randrange(3))
    live = list(h.scheduler.requests)
    if live and rng.random() < 0.08:
        victim = rng.choice(live)
        h.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    if rng.random() < 0.03:
        h.scheduler.reset_prefix_cache()  # L1 forgets: the next hits come from L2


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_traffic_keeps_every_invariant(tiny_model_dir, seed: int) -> None:
    rng = random.Random(seed)
    h = build(tiny_model_dir, seed)
    half = h.sched_half
    prefixes = [[rng.randrange(50, 450) for _ in range(rng.randint(1, 4) * BLOCK)]
                for _ in range(4)]
    next_id, history = [0], []
    for _ in range(STEPS):
        traffic_step(h, rng, prefixes, next_id, history)
        h.step(complete_async=rng.random() < 0.7)
        half.check_integrity()
    assert h.load_checks, "no load happened: the test exercised nothing"
    assert all(h.load_checks), "a loaded block did not hold the bytes computed for it"
    assert half.stats.stored_blocks > 0
    if case(seed)["hicache_write_policy"] == "write_through":
        assert half.stats.evicted_pages > 0, "L2 was never under pressure"
    drain(h)


def drain(h, max_steps: int = 400) -> None:
    """Stop traffic, deliver everything held, and wait until no pin is left."""
    half = h.sched_half
    for req_id in list(h.scheduler.requests):
        h.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    if h.worker_meta_filter is not None:
        h.worker_meta_filter.draining = True
    for _ in range(max_steps):
        h.step()
        half.check_integrity()
        if not half.has_pending_work() and not h.scheduler.has_requests():
            break
    h.step()  # acknowledges the last step's stores
    half.check_integrity()
    assert len(half.ops) == 0, half.ops.live()
    assert half.tree.num_locked_pages == 0
    assert not half.tree.allocated_pages()
