"""Write budgets (policy/write_budget.py): the bucket, the day window and
which blocks are kept, on a fake clock."""

from __future__ import annotations

import pytest

from tests.conftest import make_config
from tests.fake_clock import FakeClock
from vllm_hicache.policy.write_budget import (
    DAY_SLOT_S,
    REASON_BANDWIDTH,
    REASON_DAY,
    SECONDS_PER_DAY,
    WriteBudget,
    WriteBudgetConfig,
    block_value,
    pick_within,
)


def test_the_bucket_starts_full_refills_at_the_rate_and_caps_at_the_burst():
    clock = FakeClock(1000.0)
    b = WriteBudget(WriteBudgetConfig(bytes_per_s=100, burst_bytes=300), clock)
    assert b.room() == (300, REASON_BANDWIDTH)
    b.spend(250)
    assert b.room()[0] == 50
    clock.now += 1.0
    assert b.room()[0] == 150
    clock.now += 100.0
    assert b.room()[0] == 300  # capped at the burst


def test_burst_defaults_to_one_second_of_the_rate():
    b = WriteBudget(WriteBudgetConfig(bytes_per_s=100), FakeClock(1000.0))
    assert b.room()[0] == 100


def test_what_is_spent_over_any_interval_stays_within_burst_plus_rate_times_time():
    clock = FakeClock(1000.0)
    b = WriteBudget(WriteBudgetConfig(bytes_per_s=1000, burst_bytes=4000), clock)
    spent = 0
    for _ in range(200):  # a greedy writer, every 10 ms
        room, _ = b.room()
        take = int(room // 100) * 100
        b.spend(take)
        spent += take
        clock.now += 0.01
    assert spent <= 4000 + 1000 * 2.0


def test_the_day_window_limits_24_hours_and_frees_old_hours():
    clock = FakeClock(1000.0)
    b = WriteBudget(WriteBudgetConfig(bytes_per_day=1000), clock)
    assert b.room() == (1000, REASON_DAY)
    b.spend(600)
    clock.now += 5 * DAY_SLOT_S
    b.spend(400)
    assert b.room()[0] == 0
    clock.now += SECONDS_PER_DAY - 5 * DAY_SLOT_S  # the first hour's 600 leave
    assert b.room()[0] == 600
    clock.now += 5 * DAY_SLOT_S
    assert b.room()[0] == 1000


def test_the_tighter_limit_binds_and_names_itself():
    clock = FakeClock(1000.0)
    b = WriteBudget(WriteBudgetConfig(bytes_per_s=100, burst_bytes=500, bytes_per_day=800), clock)
    assert b.room() == (500, REASON_BANDWIDTH)
    b.spend(500)
    clock.now += 10.0
    assert b.room() == (300, REASON_DAY)


def test_no_limit_is_infinite_room():
    b = WriteBudget(WriteBudgetConfig(), FakeClock(1000.0))
    assert not b.enabled and b.room()[0] == float("inf")


def test_the_most_valuable_blocks_are_kept_a_chain_keeps_its_prefix():
    # One chain of 4 blocks, no uses: the shallowest win.
    values = [block_value(0, d) for d in range(4)]
    assert pick_within(values, item_bytes=10, room_bytes=25) == {0, 1}
    # A used block of another chain beats unused ones.
    values = [block_value(0, 0), block_value(0, 1), block_value(3, 5)]
    assert pick_within(values, 10, 20) == {0, 2}
    assert pick_within(values, 10, float("inf")) == {0, 1, 2}
    assert pick_within(values, 10, 5) == set()


def test_limits_that_cannot_admit_one_block_are_refused_by_name():
    with pytest.raises(ValueError, match="l3_write_burst_bytes=100 is below one block"):
        WriteBudgetConfig(bytes_per_s=10_000, burst_bytes=100).check_block(1000)
    with pytest.raises(ValueError, match="l3_write_budget_bytes_per_s .*one second"):
        WriteBudgetConfig(bytes_per_s=100).check_block(1000)
    with pytest.raises(ValueError, match="l3_write_budget_bytes_per_day=100"):
        WriteBudgetConfig(bytes_per_day=100).check_block(1000)
    WriteBudgetConfig(bytes_per_s=100, burst_bytes=1000).check_block(1000)


def storage(**extra):
    return make_config(hicache_storage_backend="file",
                       hicache_storage_backend_extra_config={"path": "/x", **extra}).storage


def test_the_keys_parse_with_units_and_bad_values_are_named():
    st = storage(l3_write_budget_bytes_per_s="10MB", l3_write_burst_bytes="64MB",
                 l3_write_budget_bytes_per_day=10**12)
    assert st.write_budget == WriteBudgetConfig(10 << 20, 64 << 20, 10**12)
    assert not storage().write_budget.enabled
    with pytest.raises(ValueError, match="l3_write_budget_bytes_per_s"):
        storage(l3_write_budget_bytes_per_s=-1)
    with pytest.raises(ValueError, match="l3_write_budget_bytes_per_day"):
        storage(l3_write_budget_bytes_per_day="lots")
    with pytest.raises(ValueError, match="l3_write_burst_bytes set .* without"):
        storage(l3_write_burst_bytes=1000)
