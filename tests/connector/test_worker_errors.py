"""A copy that raises never kills the worker, on CPU and on (faked) CUDA.

Failed loads become load errors for exactly the failing job's blocks; failed
stores are reported to the scheduler and their pages are never read again
(no load, no L3 backup) until something rewrites them. The CUDA branch runs
here with fake streams and events (copies themselves are synchronous CPU
copies), which is enough to exercise its control flow.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from tests.connector.harness import LAYERS, make_harness
from vllm_hicache.common.jobs import BackupJob, BlockCopy, LoadJob, PrefetchJob, PrefetchProgress
from vllm_hicache.connector.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from vllm_hicache.datapath import KVDataPath

# --- fakes ------------------------------------------------------------------


class FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        self.recorded_on = None

    def record(self, stream=None) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.recorded_on is not None

    def synchronize(self) -> None:
        assert self.recorded_on is not None, "synchronize on an event never recorded"


class FakeStream:
    def __init__(self, name: str = "transfer", *args, **kwargs) -> None:
        self.name = name
        self.waited_events: list[FakeEvent] = []

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        assert isinstance(event, FakeEvent) and event.recorded_on is not None, event
        self.waited_events.append(event)


class FailingTransfer:
    """Wraps the real transfer; raises when ``should_fail(op, layer, pages)``."""

    def __init__(self, inner, should_fail) -> None:
        self._inner = inner
        self._should_fail = should_fail
        # (op, layer or None, page ids) of every call, failed or not.
        self.calls: list[tuple[str, int | None, tuple[int, ...]]] = []

    def _check(self, op: str, layer, page_ids) -> None:
        self.calls.append((op, layer, tuple(page_ids)))
        if self._should_fail(op, layer, tuple(page_ids)):
            raise RuntimeError(f"injected {op} failure")

    def load_layer(self, layer_index, block_ids, page_ids) -> None:
        self._check("load_layer", layer_index, page_ids)
        self._inner.load_layer(layer_index, block_ids, page_ids)

    def load(self, block_ids, page_ids) -> None:
        self._check("load", None, page_ids)
        self._inner.load(block_ids, page_ids)

    def store(self, block_ids, page_ids) -> None:
        self._check("store", None, page_ids)
        self._inner.store(block_ids, page_ids)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class RecordingIO:
    """Stands in for StorageIO: records what the worker submits."""

    worker_id = 0
    pages = SimpleNamespace(backend=None)  # no node tier to count

    def __init__(self) -> None:
        self.backups: list[BackupJob] = []
        self.prefetches: list[PrefetchJob] = []

    def submit_backup(self, job, ready=None) -> None:
        self.backups.append(job)

    def submit_prefetch(self, job, ready=None, by_layer=False) -> None:
        self.prefetches.append(job)

    def poll(self):
        return {}, set()

    def take_backup_failures(self):
        return {}

    def take_removed_keys(self):
        return []

    def take_prefetch_timings(self):
        return {}

    def shutdown(self) -> None:
        pass


# --- fixtures -----------------------------------------------------------------


@pytest.fixture(params=["cpu", "fake_cuda"])
def device(request, monkeypatch):
    if request.param == "fake_cuda":
        compute = FakeStream("compute")
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: compute)
        return compute
    return None


@pytest.fixture
def rig(tiny_model_dir, device):
    h = make_harness(tiny_model_dir)
    w = h.worker.worker
    if device is not None:
        # What register_kv_caches sets up on a CUDA device.
        w.data.async_loads.shutdown()
        w.data = KVDataPath(w.data.pool, w.data.transfer, stream=torch.cuda.Stream(),
                            clock=w.clock)
    torch.manual_seed(0)
    for t in h.kv.values():
        t.copy_(torch.randn_like(t))
    yield h, w, device
    w.shutdown()


def inject(w, should_fail) -> FailingTransfer:
    wrapper = FailingTransfer(w.transfer, should_fail)
    w.transfer = wrapper  # the async loader's too
    return wrapper


def run_step(h, w, meta: HiCacheMetadata, timeout_s: float = 10.0):
    """One step in the runner's order; returns (finished loads, load errors,
    worker metadata). Waits (bounded) until every async load is reported."""
    w.handle_preemptions(meta)
    w.bind(meta)
    w.start_load_kv()
    for name in h.kv:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    want = {job.req_id for job in meta.async_loads}
    finished: set[str] = set()
    deadline_s = time.monotonic() + timeout_s
    while True:
        _, recving = w.get_finished()
        finished |= recving or set()
        if want <= finished or time.monotonic() > deadline_s:
            break
        time.sleep(0.001)
    errors = w.take_load_errors()
    worker_meta = w.worker_meta()
    w.clear()
    return finished, errors, worker_meta


def store_blocks(h, w, blocks, pages) -> None:
    _, errors, worker_meta = run_step(h, w, HiCacheMetadata(stores=BlockCopy(blocks, pages)))
    assert not errors and worker_meta is None


def same_kv(h, block_a: int, block_b: int) -> bool:
    return all(torch.equal(t[block_a], t[block_b]) for t in h.kv.values())


# Stored in every test: L1 blocks 0..5 -> host pages 0..5.
SRC_BLOCKS = (0, 1, 2, 3, 4, 5)
SRC_PAGES = (0, 1, 2, 3, 4, 5)
GOOD = LoadJob("good", BlockCopy((10, 11, 12), (0, 1, 2)))
BAD = LoadJob("bad", BlockCopy((20, 21, 22), (3, 4, 5)))
BAD_PAGE = 4


# --- loads ------------------------------------------------------------------


@pytest.mark.parametrize("fail_layer", [0, LAYERS - 1])
def test_layerwise_load_failure_fails_only_its_job(rig, fail_layer):
    h, w, compute = rig
    store_blocks(h, w, SRC_BLOCKS, SRC_PAGES)
    wrapper = inject(w, lambda op, layer, pages: op == "load_layer" and layer == fail_layer
                     and BAD_PAGE in pages)
    _, errors, _ = run_step(h, w, HiCacheMetadata(loads=[GOOD, BAD]))

    assert errors == set(BAD.copy.block_ids)
    for dst, src in zip(GOOD.copy.block_ids, GOOD.copy.page_ids):
        assert same_kv(h, dst, SRC_BLOCKS[SRC_PAGES.index(src)])
    # The failed job is never copied again after the layer that failed.
    bad_layers = [layer for op, layer, pages in wrapper.calls if pages == BAD.copy.page_ids]
    assert bad_layers == list(range(fail_layer + 1))
    good_layers = [layer for op, layer, pages in wrapper.calls if pages == GOOD.copy.page_ids]
    assert good_layers == list(range(LAYERS))
    if compute is not None:
        # Every layer's event was recorded and waited on by the compute stream.
        events = [w.data.layer_event(layer) for layer in range(LAYERS)]
        assert all(e is not None for e in events)
        waited = {id(e) for e in compute.waited_events}
        assert all(id(e) in waited for e in events)


def test_layer_hook_skipped_still_skips_failed_job(rig):
    """wait_for_save's catch-up loads honour a failure from an earlier layer."""
    h, w, _ = rig
    store_blocks(h, w, SRC_BLOCKS, SRC_PAGES)
    wrapper = inject(w, lambda op, layer, pages: op == "load_layer" and BAD_PAGE in pages)
    meta = HiCacheMetadata(loads=[GOOD, BAD])
    w.handle_preemptions(meta)
    w.bind(meta)
    w.start_load_kv()
    w.wait_for_layer_load(next(iter(h.kv)))  # later layer hooks never run
    w.wait_for_save()
    errors = w.take_load_errors()
    w.clear()

    # Skipped hooks make vLLM recompute every load of the step; no crash.
    assert errors == set(GOOD.copy.block_ids) | set(BAD.copy.block_ids)
    bad_calls = [c for c in wrapper.calls if c[2] == BAD.copy.page_ids]
    assert len(bad_calls) == 1


def test_async_load_failure_is_finished_with_its_blocks_failed(rig):
    h, w, _ = rig
    store_blocks(h, w, SRC_BLOCKS, SRC_PAGES)
    inject(w, lambda op, layer, pages: op == "load" and BAD_PAGE in pages)
    finished, errors, _ = run_step(h, w, HiCacheMetadata(async_loads=[GOOD, BAD]))

    assert finished == {"good", "bad"}
    assert errors == set(BAD.copy.block_ids)
    for dst, src in zip(GOOD.copy.block_ids, GOOD.copy.page_ids):
        assert same_kv(h, dst, SRC_BLOCKS[SRC_PAGES.index(src)])
    assert w.data.async_loads.num_inflight == 0


# --- stores -----------------------------------------------------------------


def test_failed_store_is_reported_once_and_never_read(rig):
    h, w, _ = rig
    store_blocks(h, w, SRC_BLOCKS, SRC_PAGES)
    w._rank_l3.io = RecordingIO()
    wrapper = inject(w, lambda op, layer, pages: op == "store" and 40 in pages)
    failed_copy = BlockCopy((30, 31), (40, 41))
    backup = BackupJob(7, (b"a", b"b", b"c"), (2, 40, 41))
    _, errors, worker_meta = run_step(
        h, w, HiCacheMetadata(stores=failed_copy, backups=[backup]))

    assert not errors
    assert worker_meta.failed_store_pages == {40, 41}
    # The backup of that same step writes only the page that is good.
    assert w._io.backups == [BackupJob(7, (b"a",), (2,))]

    # Reported once; the scheduler may still plan reads of those pages
    # before it hears, and they must fail rather than load garbage.
    reader = LoadJob("reader", BlockCopy((50, 51), (1, 41)))
    waiter = LoadJob("waiter", BlockCopy((52,), (40,)))
    finished, errors, worker_meta = run_step(
        h, w, HiCacheMetadata(loads=[reader, GOOD], async_loads=[waiter]))
    assert worker_meta is None
    assert finished == {"waiter"}
    assert errors == {50, 51, 52}
    assert not any(41 in pages or 40 in pages for op, _, pages in wrapper.calls if op != "store")


def test_rewritten_pages_are_readable_again(rig):
    h, w, _ = rig
    w._rank_l3.io = RecordingIO()
    fail = {"on": True}
    inject(w, lambda op, layer, pages: fail["on"] and op == "store")
    _, _, worker_meta = run_step(h, w, HiCacheMetadata(stores=BlockCopy((0, 1), (60, 61))))
    assert worker_meta.failed_store_pages == {60, 61}

    fail["on"] = False
    store_blocks(h, w, (2,), (60,))  # a later store succeeds
    prefetch = PrefetchJob(3, (b"x",), (61,))
    run_step(h, w, HiCacheMetadata(prefetches=[prefetch]))  # an L3 read rewrites 61
    assert w._io.prefetches == [prefetch]

    _, errors, _ = run_step(h, w, HiCacheMetadata(loads=[LoadJob("r", BlockCopy((40,), (60,)))]))
    assert not errors
    assert same_kv(h, 40, 2)
    _, errors, _ = run_step(h, w, HiCacheMetadata(loads=[LoadJob("s", BlockCopy((41,), (61,)))]))
    assert not errors


def test_failed_write_back_is_reported_and_ordered(rig):
    h, w, compute = rig
    inject(w, lambda op, layer, pages: op == "store" and 9 in pages)
    _, errors, worker_meta = run_step(
        h, w, HiCacheMetadata(evict_stores=BlockCopy((0, 1), (8, 9))))

    assert not errors
    assert worker_meta.failed_store_pages == {8, 9}
    if compute is not None:
        # The compute stream still waits for whatever part of the copy was queued.
        assert compute.waited_events and compute.waited_events[-1] is w.data.store_event


def test_failed_store_pages_aggregate_across_ranks():
    a = HiCacheWorkerMetadata(failed_store_pages={1, 2})
    b = HiCacheWorkerMetadata(failed_store_pages={2, 5}, backups={3: {1}})
    merged = a.aggregate(b)
    assert merged.failed_store_pages == {1, 2, 5}
    assert merged.backups == {3: {1}}


def test_a_failed_load_drops_the_stores_of_its_step(rig):
    """The forward that follows a failed layerwise load computes over KV
    that never arrived: the blocks it stores are reported as failed, never
    copied, and left out of the step's backup."""
    h, w, _ = rig
    store_blocks(h, w, SRC_BLOCKS, SRC_PAGES)
    wrapper = inject(w, lambda op, layer, pages: op == "load_layer" and BAD_PAGE in pages)
    w._rank_l3.io = RecordingIO()
    new = BlockCopy((30, 31), (8, 9))
    meta = HiCacheMetadata(loads=[GOOD, BAD], stores=new,
                           backups=[BackupJob(7, (b"h8", b"h9"), (8, 9))])
    _, errors, worker_meta = run_step(h, w, meta)
    assert errors == set(BAD.copy.block_ids)
    assert not [c for c in wrapper.calls if c[0] == "store"], "a store ran after a failed load"
    assert worker_meta.failed_store_pages == {8, 9}
    assert w._io.backups and not w._io.backups[0].pages


def test_a_hook_without_what_it_needs_names_it(tiny_model_dir):
    """An L3 job reaching a rank with no storage client is answered at once
    (a prefetch that read nothing: the scheduler never waits on it); a step
    hook before the KV caches are registered fails naming what is missing."""
    h = make_harness(tiny_model_dir)
    w = h.worker.worker
    assert w._io is None
    w.bind(HiCacheMetadata(prefetches=[PrefetchJob(3, (b"x",), (61,))]))
    report = w.worker_meta()
    assert report.prefetch == {3: {0: PrefetchProgress(0, True)}}
    data, w.data = w.data, None
    try:
        with pytest.raises(RuntimeError, match="KV caches are not registered yet"):
            w.handle_preemptions(HiCacheMetadata())
        assert w.worker_meta() is None  # nothing to report is still fine
    finally:
        w.data = data
