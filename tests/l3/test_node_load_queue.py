"""The worker's queue of direct node-tier loads (l3/node_load_queue.py):
every job is reported finished exactly once, and the blocks after what it
loaded are load errors, also when the loader raises or is missing."""

from __future__ import annotations

import time

import torch

from vllm_hicache.common.jobs import NodeLoadJob
from vllm_hicache.l3.node_load_queue import NodeLoadQueue, node_load_queue

JOB = NodeLoadJob("r", (b"a" * 32, b"b" * 32, b"c" * 32), (4, 5, 6))


class FakeLoader:
    def __init__(self, loaded=None, error=None) -> None:
        self.loaded, self.error, self.closed = loaded, error, False

    def load(self, hashes, block_ids):
        if self.error is not None:
            raise self.error
        return self.loaded

    def close(self) -> None:
        self.closed = True


def drain(queue: NodeLoadQueue) -> tuple[set[str], set[int]]:
    assert queue.wait_idle(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, failed = queue.poll()
        if done:
            assert queue.poll() == (set(), set())  # reported once
            return done, failed
    raise AssertionError("job never reported")


def test_the_blocks_after_the_loaded_prefix_are_load_errors():
    queue = NodeLoadQueue(FakeLoader(loaded=1), torch.device("cpu"))  # type: ignore[arg-type]
    queue.submit([JOB])
    assert drain(queue) == ({"r"}, {5, 6})
    queue.shutdown()


def test_a_raising_loader_fails_the_whole_job_and_still_reports_it():
    loader = FakeLoader(error=RuntimeError("boom"))
    queue = NodeLoadQueue(loader, torch.device("cpu"))  # type: ignore[arg-type]
    queue.submit([JOB])
    assert drain(queue) == ({"r"}, {4, 5, 6})
    queue.shutdown()
    assert loader.closed


def test_without_a_loader_every_job_is_recomputed():
    queue = NodeLoadQueue(None, torch.device("cpu"))
    queue.submit([JOB])
    assert drain(queue) == ({"r"}, {4, 5, 6})
    queue.shutdown()


def test_no_node_tier_means_no_queue():
    assert node_load_queue(object(), [torch.zeros(1)], [], "direct", False) is None


# --- in step: the request was admitted with a synchronous load -------------

STEP_JOB = NodeLoadJob("s", JOB.hashes, (7, 8, 9), in_step=True)


class CountingLoader(FakeLoader):
    def __init__(self, loaded: int) -> None:
        super().__init__(loaded=loaded)
        self.counts = {"pages": 0}

    def load(self, hashes, block_ids):
        self.counts["pages"] += self.loaded
        return self.loaded


def test_in_step_jobs_load_before_the_call_returns_and_report_the_rest_as_errors():
    loader = CountingLoader(loaded=2)
    queue = NodeLoadQueue(loader, torch.device("cpu"))  # type: ignore[arg-type]
    assert queue.load_in_step([STEP_JOB, JOB]) == {9, 6}
    # Nothing is left to report as finished: vLLM never waited for them.
    assert queue.poll() == (set(), set())
    queue.shutdown()


def test_a_raising_loader_fails_an_in_step_job_without_raising_into_the_forward():
    queue = NodeLoadQueue(FakeLoader(error=RuntimeError("boom")),  # type: ignore[arg-type]
                          torch.device("cpu"))
    assert queue.load_in_step([STEP_JOB]) == {7, 8, 9}
    queue.shutdown()


def test_without_a_loader_in_step_jobs_are_recomputed():
    queue = NodeLoadQueue(None, torch.device("cpu"))
    assert queue.load_in_step([STEP_JOB]) == {7, 8, 9}
    assert queue.take_counts() == {}
    queue.shutdown()


def test_loaded_pages_are_counted_once_for_the_direct_load_counter():
    loader = CountingLoader(loaded=3)
    queue = NodeLoadQueue(loader, torch.device("cpu"))  # type: ignore[arg-type]
    queue.load_in_step([STEP_JOB])
    queue.submit([JOB])
    drain(queue)
    assert queue.take_counts() == {"node_tier_direct_loaded_pages": 6.0}
    assert queue.take_counts() == {}
    queue.shutdown()
