"""hicache_load_decision=auto through vLLM's real Scheduler and our worker
half: a tier slower than computing is declined, a fast one is loaded; and
L3 backups beyond the in-flight bound are deferred, counted, bounded and
caught up when the engine idles."""

from __future__ import annotations

import time

from tests.connector.harness import BLOCK, make_harness
from tests.connector.test_metrics import kv_stats_sent, total
from tests.l3.test_planner import (
    forget_l1_and_l2,
    hold_backups,
    l3_harness,
    num_pages_stored,
)
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.common.stats import key
from vllm_hicache.planner.log_format import Admit, read_logs
from vllm_hicache.planner.report import CostModel, build_plan, format_report
from vllm_hicache.policy.offload import BackupBacklog

# A harness page is 16 KiB: at 256 KiB/s a 4-page prefetch takes 0.25 s,
# against about a millisecond of (fake) compute for 64 tokens.
SLOW_READ = 256 * 1024


def warm_prefill(h, seed: int, n: int = 4) -> None:
    """Prefill samples for the estimator: a few distinct prompts."""
    for i in range(n):
        h.add(f"warm{seed}-{i}", prompt(seed + i, 4 * BLOCK + 3), max_tokens=1)
        h.run()
    assert h.sched_half.load_gate.decider.prefill.ready


def l3_round(h, name: str, tokens) -> int:
    """Forget L1 and L2, run one request of ``tokens``: tokens it did not compute."""
    forget_l1_and_l2(h)
    h.add(name, tokens, max_tokens=1)
    h.run()
    h.step()
    return h.first_computed[name]


def test_slow_l3_hit_is_declined_and_recomputed(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir, read_bytes_per_s=SLOW_READ)
    warm_prefill(h, 500)
    tokens = prompt(510, 4 * BLOCK + 1)
    h.add("a", tokens, max_tokens=1)
    h.run()
    h.step()
    assert num_pages_stored(store) >= 4
    gate = h.sched_half.load_gate
    # Cold: every prefetch is waited for (and measures L3).
    cold = 0
    while not gate.decider.l3.ready:
        assert l3_round(h, f"cold{cold}", tokens) == 4 * BLOCK
        cold += 1
        assert cold <= 5
    assert gate.decisions[("L3", "loaded")] == cold * 4 * BLOCK
    # Warm: computing 64 tokens beats reading them; the request does not wait.
    started = time.monotonic()
    assert l3_round(h, "warm", tokens) == 0
    assert time.monotonic() - started < 2.0
    # The declined lookup finishes in its thread, maybe after the request.
    deadline = time.monotonic() + 5
    while ("L3", "declined") not in gate.decisions and time.monotonic() < deadline:
        h.step()
        time.sleep(0.01)
    assert gate.decisions[("L3", "declined")] == 4 * BLOCK
    assert h.load_checks and all(h.load_checks)
    # The declined prefetch still ran, in the background, into L2.
    deadline = time.monotonic() + 5
    while h.sched_half.l3.in_flight()["prefetches"] and time.monotonic() < deadline:
        h.step()
        time.sleep(0.01)
    sent = kv_stats_sent(h)
    assert total(sent, key("load_decisions", "L3", "declined")) == 4 * BLOCK
    assert total(sent, key("load_decisions", "L3", "loaded")) == cold * 4 * BLOCK
    latest = {}
    for p in sent:
        latest.update(p["gauges"])
    assert latest[key("estimated_bandwidth_bytes_per_second", "L3")] < 2 * SLOW_READ
    assert latest[key("estimated_prefill_tokens_per_second")] > 0
    assert_clean(h)


def test_fast_l3_hit_is_loaded(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir)
    warm_prefill(h, 600)
    tokens = prompt(610, 4 * BLOCK + 1)
    h.add("a", tokens, max_tokens=1)
    h.run()
    h.step()
    for r in range(4):
        assert l3_round(h, f"r{r}", tokens) == 4 * BLOCK
    gate = h.sched_half.load_gate
    assert gate.decider.l3.ready
    assert gate.decisions.get(("L3", "declined"), 0) == 0
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_slow_l2_hit_is_declined_and_recomputed(tiny_model_dir, tmp_path):
    log_path = tmp_path / "access.log"
    h = make_harness(tiny_model_dir, hicache_access_log=str(log_path))
    warm_prefill(h, 700)
    decider = h.sched_half.load_gate.decider
    tokens = prompt(710, 4 * BLOCK + 1)
    h.add("a", tokens, max_tokens=1)
    h.run()
    # L2 loads measured at 1 kB/s: a 4-page hit would take a minute.
    for _ in range(3):
        decider.observe_transfers(load=(1000.0, 1.0))
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens, max_tokens=1)
    h.run()
    assert h.first_computed["b"] == 0
    assert h.sched_half.load_gate.decisions[("L2", "declined")] == 4 * BLOCK
    # Declined, not forgotten: the pages stay in L2, and a fast L2 loads them.
    for _ in range(5):
        decider.observe_transfers(load=(1e12, 1.0))
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("c", tokens, max_tokens=1)
    h.run()
    assert h.first_computed["c"] == 4 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)
    # The access log tells the declined hit from a miss, and the planner says so.
    h.sched_half.access_log.close()
    log = read_logs([log_path])
    admits = [r for r in log.records if isinstance(r, Admit)]
    b, c = admits[-2:]
    assert (b.l2_tokens, b.declined_tokens) == (0, 4 * BLOCK)
    assert (c.l2_tokens, c.declined_tokens) == (4 * BLOCK, 0)
    report = format_report(build_plan(log, CostModel(), l2_gb=[], l3_gb=[]), CostModel())
    assert "declined by the server's load gate" in report


def test_always_loads_a_slow_tier(tiny_model_dir):
    h = make_harness(tiny_model_dir, hicache_load_decision="always")
    decider = h.sched_half.load_gate.decider
    for _ in range(3):
        decider.observe_transfers(load=(1000.0, 1.0))
        decider.observe_step(64, 64 * 32, 1e-3)
    tokens = prompt(720, 4 * BLOCK + 1)
    h.add("a", tokens, max_tokens=1)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens, max_tokens=1)
    h.run()
    assert h.first_computed["b"] == 4 * BLOCK


# --- backups: deferred, bounded, caught up --------------------------------------


def _l3_backlog_harness(tiny_model_dir, max_backup_pages: int):
    h, store = l3_harness(tiny_model_dir, policy="best_effort")
    h.sched_half.l3.backups.max_backup_pages = max_backup_pages
    return h, store


def run_held(h) -> None:
    """Step (backups held, async completions withheld) until no request runs."""
    for _ in range(20):
        h.step(complete_async=False)
        if not h.scheduler.has_unfinished_requests():
            break


def run_idle(h) -> None:
    """Step as vLLM does while the connector has work and no request runs."""
    for _ in range(200):
        if not h.scheduler.has_requests():
            break
        h.step()


def test_backups_over_the_bound_are_deferred_then_caught_up_when_idle(tiny_model_dir):
    h, store = _l3_backlog_harness(tiny_model_dir, max_backup_pages=4)
    planner = h.sched_half.l3
    gate = hold_backups(h)
    try:
        h.add("a", prompt(800, 6 * BLOCK + 1), max_tokens=1)
        for _ in range(20):
            h.step(complete_async=False)
            if "a" in h.first_computed and not h.scheduler.has_unfinished_requests():
                break
        # Nothing was in flight: one step's stores all go (6 pages > the bound).
        assert planner.backups.backup_deferred == 0
        h.add("b", prompt(801, 6 * BLOCK + 1), max_tokens=1)
        run_held(h)
        h.step(complete_async=False)  # b's stores acknowledged
        # 6 pages in flight >= the bound: b's 6 blocks wait, unpinned.
        assert planner.backups.backup_deferred == 6
        assert planner.backups.backlog.num_blocks == 6
        assert h.sched_half.tree.num_locked_pages == 6
    finally:
        gate.set()
    # Idle: vLLM keeps stepping while the backlog is not empty.
    run_idle(h)
    assert planner.backups.backlog.num_blocks == 0
    assert planner.backups.backup_flushed == 6
    assert num_pages_stored(store) == 12
    assert h.sched_half.tree.num_locked_pages == 0
    sent = kv_stats_sent(h)
    assert total(sent, key("backup_deferred_blocks", "deferred")) == 6
    assert total(sent, key("backup_deferred_blocks", "flushed")) == 6
    gauges = {}
    for p in sent:
        gauges.update(p["gauges"])
    assert gauges[key("backup_backlog_blocks")] == 0
    assert_clean(h)


def test_full_backlog_drops_the_least_valuable_and_counts_it(tiny_model_dir):
    h, store = _l3_backlog_harness(tiny_model_dir, max_backup_pages=1)
    planner = h.sched_half.l3
    planner.backups.backlog = BackupBacklog(max_blocks=4)
    gate = hold_backups(h)
    try:
        for i, name in enumerate("abc"):
            h.add(name, prompt(810 + i, 3 * BLOCK + 1), max_tokens=1)
            run_held(h)
        # a went out (nothing in flight); b and c (3 blocks each) were
        # deferred into a backlog of 4 blocks: 2 dropped.
        assert planner.backups.backup_deferred == 6
        assert planner.backups.backup_dropped == 2
        assert planner.backups.backlog.num_blocks == 4
    finally:
        gate.set()
    run_idle(h)
    assert planner.backups.backup_flushed == 4
    assert num_pages_stored(store) == 3 + 4
    assert_clean(h)


def test_deferred_backup_of_an_evicted_page_is_counted(tiny_model_dir):
    h, store = _l3_backlog_harness(tiny_model_dir, max_backup_pages=1)
    planner = h.sched_half.l3
    gate = hold_backups(h)
    try:
        for i, name in enumerate("ab"):
            h.add(name, prompt(820 + i, 3 * BLOCK + 1), max_tokens=1)
            run_held(h)
        h.step(complete_async=False)  # b's stores acknowledged: unpinned
        assert planner.backups.backlog.num_blocks == 3
        assert h.sched_half.reset_cache()  # b's pages leave L2 (a's are pinned)
    finally:
        gate.set()
    run_idle(h)
    assert planner.backups.backup_evicted == 3
    assert planner.backups.backup_flushed == 0
    assert num_pages_stored(store) == 3
    assert_clean(h)
