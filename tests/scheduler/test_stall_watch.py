"""The stall rule (scheduler/stall_watch.py) on a fake clock."""

from __future__ import annotations

from tests.fake_clock import FakeClock
from vllm_hicache.scheduler.stall_watch import STALLED_WORK_S, StallWatch


def test_pending_work_keeps_stepping_until_it_goes_stalled_s_without_progress():
    clock = FakeClock(50.0)
    watch = StallWatch(clock=clock)
    assert watch.keeps_stepping(True, 3)
    clock.now += STALLED_WORK_S - 0.5
    assert watch.keeps_stepping(True, 3)
    clock.now += 1.0
    assert not watch.keeps_stepping(True, 3)  # no operation finished for too long


def test_an_operation_finishing_restarts_the_clock():
    clock = FakeClock(50.0)
    watch = StallWatch(stalled_s=10.0, clock=clock)
    watch.keeps_stepping(True, 3)
    clock.now += 9.0
    assert watch.keeps_stepping(True, 2)  # one finished: progress
    clock.now += 9.0
    assert watch.keeps_stepping(True, 2)
    clock.now += 2.0
    assert not watch.keeps_stepping(True, 2)
    assert watch.keeps_stepping(True, 4)  # new ones started: progress too


def test_no_pending_work_never_keeps_stepping_and_resets_the_clock():
    clock = FakeClock(50.0)
    watch = StallWatch(stalled_s=10.0, clock=clock)
    watch.keeps_stepping(True, 3)
    clock.now += 11.0
    assert not watch.keeps_stepping(False, 3)
    # Work pending again, with the same count: measured from the idle moment.
    assert watch.keeps_stepping(True, 3)
    clock.now += 9.0
    assert watch.keeps_stepping(True, 3)
