"""L3Lookups (l3/lookups.py): the lookup thread's records, its bounds and
its hand-off to the scheduler's thread, against a store that answers when
told to."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3 import lookups as lookups_module
from vllm_hicache.l3.lookups import L3Lookups

CHAIN = tuple(bytes([i]) * 32 for i in range(4))
NS = KeyNamespace("org/model", "bfloat16", "page_first", 32, 1, 0)


class GatedStore:
    """``exists_prefix`` answers ``hit`` once ``gate`` opens (or fails with
    ``error``), counting the keys it was asked about."""

    def __init__(self, hit: int, error: Exception | None = None) -> None:
        self.hit = hit
        self.error = error
        self.gate = threading.Event()
        self.asked: list[int] = []

    def exists_prefix(self, keys) -> int:
        self.gate.wait(10)
        self.asked.append(len(keys))
        if self.error is not None:
            raise self.error
        return min(self.hit, len(keys))


def lookups(store: GatedStore) -> L3Lookups:
    return L3Lookups(store, [NS])  # type: ignore[arg-type]


def finished(lk: L3Lookups, count: int) -> list:
    out: list = []
    deadline = time.monotonic() + 5
    while len(out) < count and time.monotonic() < deadline:
        out += lk.take_finished()
        time.sleep(0.001)
    return out


def test_an_answer_is_handed_over_once_with_its_record():
    store = GatedStore(hit=3)
    lk = lookups(store)
    record = lk.start("r", CHAIN, 1, time.monotonic() + 5, nowait=False)
    assert lk.num_pending == 1 and lk.started == 1
    store.gate.set()
    ((req_id, done),) = finished(lk, 1)
    assert req_id == "r" and done is record and lk.get("r") is record
    assert lk.hit(record) == 3 and store.asked == [3]  # blocks 1.. of the chain
    assert lk.num_pending == 0 and list(lk.take_finished()) == []
    assert len(list(lk.take_seconds())) == 1
    lk.close()


def test_a_failed_lookup_is_a_counted_miss():
    store = GatedStore(hit=3, error=OSError("store down"))
    store.gate.set()
    lk = lookups(store)
    record = lk.start("r", CHAIN, 0, time.monotonic() + 5, nowait=False)
    finished(lk, 1)
    assert lk.hit(record) == 0 and lk.errors == 1
    lk.close()


def test_forget_cancels_a_queued_lookup_but_not_a_declined_one():
    store = GatedStore(hit=4)
    lk = lookups(store)
    lk.start("running", CHAIN, 0, time.monotonic() + 5, nowait=False)  # holds the thread
    queued = lk.start("queued", CHAIN, 0, time.monotonic() + 5, nowait=False)
    declined = lk.start("declined", CHAIN, 0, time.monotonic() + 5, nowait=True)
    assert lk.forget("queued") is queued and lk.forget("declined") is declined
    assert lk.get("queued") is None and queued.future.cancelled()
    store.gate.set()
    done = dict(finished(lk, 3))
    # The declined lookup still ran: its hit is what measures a declined tier.
    assert not declined.future.cancelled() and lk.hit(done["declined"]) == 4
    assert store.asked == [4, 4]  # "running" and "declined"; "queued" never ran
    lk.close()


def test_one_pass_waits_at_most_its_budget_for_every_lookup(monkeypatch):
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", 0.1)
    store = GatedStore(hit=4)
    lk = lookups(store)
    lk.new_pass()
    records = [lk.start(f"r{i}", CHAIN, 0, time.monotonic() + 5, nowait=False)
               for i in range(5)]
    started = time.monotonic()
    for record in records:
        lk.await_answer(record)
    spent = time.monotonic() - started
    # The budget once (0.1 s), not once per lookup (0.5 s).
    assert 0.09 <= spent < 0.1 + 0.25, spent
    lk.new_pass()
    started = time.monotonic()
    lk.await_answer(records[0])
    assert time.monotonic() - started >= 0.09  # a new pass has its budget again
    store.gate.set()
    finished(lk, 5)
    lk.close()


def test_an_answer_past_the_lookups_deadline_is_not_waited_for():
    store = GatedStore(hit=4)
    lk = lookups(store)
    record = lk.start("r", CHAIN, 0, time.monotonic() - 1, nowait=False)
    started = time.monotonic()
    lk.await_answer(record)
    assert time.monotonic() - started < 0.001 + 0.05
    store.gate.set()
    finished(lk, 1)
    lk.close()


def test_the_backlog_bound_and_stop(monkeypatch):
    monkeypatch.setattr(lookups_module, "MAX_PENDING_LOOKUPS", 2)
    store = GatedStore(hit=4)
    lk = lookups(store)
    for i in range(2):
        lk.start(f"r{i}", CHAIN, 0, time.monotonic() + 5, nowait=False)
    assert lk.full()
    lk.stop()
    assert lk.get("r0") is None and list(lk) == []
    store.gate.set()
    deadline = time.monotonic() + 5
    while lk.num_pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lk.num_pending == 0 and not lk.full()
    lk.close()


@pytest.mark.parametrize("hit", [0, 2])
def test_the_lookup_stops_at_the_first_namespace_that_misses(hit):
    store = GatedStore(hit=hit)
    store.gate.set()
    lk = L3Lookups(store, [NS, NS])  # type: ignore[arg-type]
    assert lk.run(CHAIN, [0]) == hit
    # The second namespace is asked only about what the first one had.
    assert store.asked == ([4] if hit == 0 else [4, 2])
    lk.close()
