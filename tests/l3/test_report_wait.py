"""The prefetch report wait (l3/report_wait.py): a step gets a budget only
while a request waits for an open prefetch; a worker spends at most that
budget, before its report, on its open prefetches, and a read that ends
within it is in that report."""

from __future__ import annotations

import threading
import time

from tests.connector.harness import make_harness
from tests.connector.test_worker_errors import RecordingIO
from tests.l3.test_lookup_wait import CHAIN, planner
from tests.l3.test_worker_io import NUM_PAGES, store  # noqa: F401 - a fixture
from vllm_hicache.common.jobs import PrefetchJob, PrefetchProgress
from vllm_hicache.connector.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from vllm_hicache.l3.report_wait import PREFETCH_REPORT_WAIT_S
from vllm_hicache.l3.worker_io import StorageIO


def started(policy: str):
    """A planner whose request "r" has a 4-block hit with its prefetch planned."""
    p = planner(answer_after_s=0.0, hit=4, policy=policy)
    p.start_lookup("r", CHAIN, 0)
    p.must_wait("r")
    deadline = time.monotonic() + 5
    while not p.lookups.has_finished() and time.monotonic() < deadline:
        time.sleep(0.0001)  # (the completion callback runs just after the answer)
    (job,) = p.plan_prefetches()
    return p, job


def finish(p, job, done: int = 4) -> None:
    p.on_worker_meta(HiCacheWorkerMetadata(prefetch={job.op_id: {0: PrefetchProgress(done,
                                                                                     True)}}))


def test_a_step_gets_the_budget_while_a_request_waits_for_its_prefetch():
    p, job = started("wait_complete")
    assert p.must_wait("r")
    assert p.report_wait_s() == PREFETCH_REPORT_WAIT_S
    finish(p, job)
    assert p.report_wait_s() == 0.0  # nothing open
    assert not p.must_wait("r")
    p.close()


def test_no_budget_once_nobody_waits():
    p, job = started("wait_complete")
    assert p.report_wait_s() == PREFETCH_REPORT_WAIT_S
    p.forget("r")  # the request finished (aborted) while its prefetch reads
    assert p.report_wait_s() == 0.0
    finish(p, job)
    p.close()


def test_no_budget_for_a_prefetch_nobody_waits_for():
    p, job = started("best_effort")  # read for later requests only
    assert not p.must_wait("r")
    assert p.report_wait_s() == 0.0
    finish(p, job)
    p.close()


def test_a_stuck_read_costs_a_worker_at_most_the_budget(store):  # noqa: F811
    gate = threading.Event()
    store.backend.get_gate = gate
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    io.submit_prefetch(PrefetchJob(1, (b"a" * 8,), (NUM_PAGES - 2,)))
    began = time.monotonic()
    io.wait_prefetches(0.05)
    waited = time.monotonic() - began
    assert 0.045 <= waited < 5.0, waited
    progress, _ = io.poll()
    assert progress == {1: PrefetchProgress(0, False)}  # still reading: reported later
    gate.set()
    began = time.monotonic()
    io.wait_prefetches(10.0)  # ends with the read, not the budget
    assert time.monotonic() - began < 5.0
    progress, _ = io.poll()
    assert progress[1].finished
    io.shutdown()


class EndsWhenWaitedFor(RecordingIO):
    """Stands in for StorageIO: its one prefetch ends inside wait_prefetches."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait_prefetches(self, timeout_s: float) -> None:
        self.waits.append(timeout_s)

    def poll(self):
        return ({7: PrefetchProgress(1, True)} if self.waits else {7: PrefetchProgress(0, False)},
                set())


def test_the_worker_waits_before_it_reports_and_only_with_a_budget(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    w = h.worker.worker
    io = EndsWhenWaitedFor()
    w._rank_l3.io = io
    try:
        w.bind(HiCacheMetadata())  # no budget: no wait, the read is reported later
        assert w.worker_meta().prefetch == {7: {0: PrefetchProgress(0, False)}}
        w.clear()
        assert io.waits == []
        w.bind(HiCacheMetadata(prefetch_wait_s=0.25))
        assert w.worker_meta().prefetch == {7: {0: PrefetchProgress(1, True)}}
        w.clear()
        assert io.waits == [0.25]
    finally:
        w.shutdown()
