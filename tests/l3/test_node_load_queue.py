"""The worker's queue of direct node-tier loads (l3/node_load_queue.py):
every job is reported finished exactly once, and the blocks after what it
loaded are load errors, also when the loader raises or is missing."""

from __future__ import annotations

import threading
import time

import torch

from vllm_hicache.common.jobs import NodeLoadJob
from vllm_hicache.l3.node_load_queue import (
    L1Target,
    NodeLoadQueue,
    WorkerNodeLoads,
    node_load_queue,
)
from vllm_hicache.l3.node_loads import OpenLoad

JOB = NodeLoadJob("r", (b"a" * 32, b"b" * 32, b"c" * 32), (4, 5, 6))


class FakeLoader:
    def __init__(self, loaded=None, error=None) -> None:
        self.loaded, self.error, self.closed = loaded, error, False

    def load(self, hashes, block_ids, defer=None):
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
    assert node_load_queue(object(), L1Target([torch.zeros(1)], [], "direct"), False) is None


# --- in step: the request was admitted with a synchronous load -------------

STEP_JOB = NodeLoadJob("s", JOB.hashes, (7, 8, 9), in_step=True)


class CountingLoader(FakeLoader):
    def __init__(self, loaded: int) -> None:
        super().__init__(loaded=loaded)
        self.counts = {"pages": 0}

    def load(self, hashes, block_ids, defer=None):
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


# --- an admin switch of the L3 client: the loader replaced between steps ---

class BlockingLoader(CountingLoader):
    """Loads ``loaded`` pages once ``go`` is set."""

    def __init__(self, loaded: int) -> None:
        super().__init__(loaded=loaded)
        self.go = threading.Event()

    def load(self, hashes, block_ids, defer=None):
        assert self.go.wait(10)
        return super().load(hashes, block_ids, defer)


def test_a_replaced_loader_closes_after_the_jobs_queued_before_the_switch():
    old, new = BlockingLoader(loaded=1), CountingLoader(loaded=3)
    queue = NodeLoadQueue(old, torch.device("cpu"))  # type: ignore[arg-type]
    second = NodeLoadJob("r2", JOB.hashes, (1, 2, 3))
    queue.submit([JOB, second])
    deadline = time.monotonic() + 10
    while not queue._loader_lock.locked() and time.monotonic() < deadline:
        time.sleep(0.001)  # the first job holds the old loader
    switch = threading.Thread(target=queue.replace_loader, args=(new,))
    switch.start()
    time.sleep(0.05)
    assert not old.closed  # never under a job that uses it
    old.go.set()
    switch.join(10)
    assert queue.wait_idle(10)
    done: set[str] = set()
    failed: set[int] = set()
    while len(done) < 2 and time.monotonic() < deadline:
        got, lost = queue.poll()
        done |= got
        failed |= lost
    # The running job ended on the old loader (1 of 3 pages); the queued one
    # ran on whichever loader was in place when it started.
    assert done == {"r", "r2"} and {5, 6} <= failed
    assert old.counts["pages"] + new.counts["pages"] == 1 + (3 - len(failed - {5, 6}))
    while not old.closed and time.monotonic() < deadline:
        time.sleep(0.001)  # on the queue's thread, after the jobs queued before the switch
    assert old.closed
    queue.shutdown()
    assert new.closed


def test_the_direct_load_counter_goes_on_across_a_replaced_loader():
    first = CountingLoader(loaded=3)
    queue = NodeLoadQueue(first, torch.device("cpu"))  # type: ignore[arg-type]
    queue.load_in_step([STEP_JOB])
    assert queue.take_counts() == {"node_tier_direct_loaded_pages": 3.0}
    queue.load_in_step([STEP_JOB])  # 3 more, not yet taken
    queue.replace_loader(CountingLoader(loaded=2))  # type: ignore[arg-type]
    queue.load_in_step([STEP_JOB])
    assert queue.take_counts() == {"node_tier_direct_loaded_pages": 5.0}
    queue.replace_loader(None)  # detached: recomputed, nothing counted
    assert queue.load_in_step([STEP_JOB]) == {7, 8, 9}
    assert queue.take_counts() == {}
    queue.shutdown()
    assert first.closed


# --- in step on CPU: each layer copied as the forward reaches it ------------

class LayerLoader(FakeLoader):
    """begin/copy/finish of NodeDirectLoader, recording the layer copies;
    ``usable`` pages pass their checks, ``held`` of them keep their seals."""

    def __init__(self, usable: int, held: int) -> None:
        super().__init__()
        self.usable, self.held, self.copies, self.finished = usable, held, [], []

    def begin(self, hashes, block_ids):
        return OpenLoad([], tuple(block_ids), len(hashes), self.usable)

    def copy(self, op, layer=None):
        self.copies.append((op.block_ids[:op.usable], layer))

    def finish(self, op, defer=None):
        self.finished.append(op.block_ids)
        return 0 if op.failed else self.held


def layered(loader, num_layers: int = 3) -> NodeLoadQueue:
    return NodeLoadQueue(loader, torch.device("cpu"), num_layers)  # type: ignore[arg-type]


def test_on_cpu_each_layer_is_copied_when_the_forward_reaches_it():
    loader = LayerLoader(usable=2, held=2)
    queue = layered(loader)
    assert queue.start_in_step([STEP_JOB]) == {9}  # failed its checks: known before
    assert loader.copies == []
    for layer in range(3):
        queue.load_layer(layer)
        queue.load_layer(layer)  # a second call for a layer copies nothing more
    assert loader.copies == [((7, 8), 0), ((7, 8), 1), ((7, 8), 2)]
    assert queue.finish_in_step() == set()
    assert loader.finished == [(7, 8, 9)]
    assert queue.finish_in_step() == set()  # closed: the next step starts afresh
    queue.shutdown()


def test_a_seal_lost_during_the_forward_is_a_late_load_error():
    loader = LayerLoader(usable=3, held=1)
    queue = layered(loader)
    assert queue.start_in_step([STEP_JOB]) == set()
    for layer in range(3):
        queue.load_layer(layer)
    assert queue.finish_in_step() == {8, 9}
    queue.shutdown()


def test_a_forward_that_skipped_a_layer_fails_every_block_it_was_promised():
    loader = LayerLoader(usable=3, held=3)
    queue = layered(loader)
    queue.start_in_step([STEP_JOB])
    queue.load_layer(0)
    queue.load_layer(2)
    assert queue.finish_in_step() == {7, 8, 9}
    queue.shutdown()


def test_without_layer_copies_in_step_loads_copy_every_layer_up_front():
    loader = CountingLoader(loaded=2)
    queue = NodeLoadQueue(loader, torch.device("cpu"), 0)  # type: ignore[arg-type]
    assert not queue._layerwise  # as on CUDA (a stream waits): whole loads
    assert queue.start_in_step([STEP_JOB]) == {9}
    assert loader.counts["pages"] == 2
    assert queue.finish_in_step() == set()
    queue.shutdown()


# --- the worker's driver: which queue, which loader, what is unreported ---

def test_the_driver_fails_jobs_it_has_no_tier_for_and_reports_each_block_once():
    node = WorkerNodeLoads(hybrid=False)
    node.follow(None)  # before bind: nothing to follow yet
    assert node.queue is None
    node.bind(L1Target([torch.zeros(1)], [], "direct"), pages=None)
    assert node.queue is None  # no L3: no node tier
    assert node.start([], torch.device("cpu")) == set()
    assert node.queue is None  # no job, no queue
    assert node.start([JOB, STEP_JOB], torch.device("cpu")) == {7, 8, 9}  # in step: now
    assert node.queue is not None and node.queue.wait_idle(10)
    deadline = time.monotonic() + 10
    done: set[str] = set()
    while not done and time.monotonic() < deadline:
        done = node.poll()
    assert done == {"r"}
    assert node.take_errors() == {4, 5, 6, 7, 8, 9}
    assert node.take_errors() == set()
    node.shutdown()
    assert node.queue is None


def test_the_driver_keeps_its_queue_and_swaps_the_loader_when_the_client_changes():
    node = WorkerNodeLoads(hybrid=False)
    node.bind(L1Target([torch.zeros(1)], [], "direct"), pages=None)
    node.queue = queue = NodeLoadQueue(CountingLoader(loaded=3), torch.device("cpu"))
    old = queue.loader
    node.follow(None)  # detached: jobs fail from now on
    assert node.queue is queue and queue.loader is None
    assert node.start([STEP_JOB], torch.device("cpu")) == {7, 8, 9}
    assert node.finish_in_step() == set()
    assert node.take_errors() == {7, 8, 9}
    node.shutdown()
    assert old.closed
