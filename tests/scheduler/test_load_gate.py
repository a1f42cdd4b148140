"""LoadGate (scheduler/load_gate.py): step times and transfers as the
scheduler process sees them, and the decisions it counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.fake_clock import FakeClock
from vllm_hicache.common.stats import key
from vllm_hicache.connector.metrics import HiCacheKVConnectorStats
from vllm_hicache.policy.load import attention_pairs
from vllm_hicache.scheduler.load_gate import LoadGate


def output(prefills: dict[str, tuple[int, int]], decodes: int = 0):
    """A SchedulerOutput of new requests {id: (tokens, computed)} plus ``decodes``
    running requests at context 100."""
    new = [SimpleNamespace(req_id=r, num_computed_tokens=c) for r, (_, c) in prefills.items()]
    scheduled = {r: n for r, (n, _) in prefills.items()}
    ids = [f"d{i}" for i in range(decodes)]
    scheduled.update(dict.fromkeys(ids, 1))
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[100] * decodes),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))


def stats(load=(0, 0), prefetch=(0, 0)):
    return HiCacheKVConnectorStats.of({
        key("transfer_bytes", "load"): load[0], key("transfer_seconds", "load"): load[1],
        key("transfer_bytes", "prefetch"): prefetch[0],
        key("transfer_seconds", "prefetch"): prefetch[1]}, {})


def test_sync_steps_are_timed_from_plan_to_result():
    clock = FakeClock(100.0)
    gate = LoadGate("auto", 1 << 16, clock=clock)
    for n in (512, 1024, 2048, 256):
        gate.step_planned(output({"a": (n, 0)}), copies_in_forward=False)
        clock.now += n * 1e-4                 # the forward: 0.1 ms per token
        gate.step_done(None)
        clock.now += 5.0                      # idle: not counted
    assert gate.decider.prefill.compute_s(0, 1000) == pytest.approx(0.1, rel=0.01)


def test_async_steps_are_timed_from_the_previous_result():
    """Step N+1 is planned while N runs: its time starts when N's result is in."""
    clock = FakeClock(100.0)
    gate = LoadGate("auto", 1 << 16, clock=clock)
    gate.step_planned(output({"a": (1000, 0)}), False)
    for i in range(6):
        clock.now += 0.001
        gate.step_planned(output({f"b{i}": (1000, 0)}), False)  # N+1 planned
        clock.now += 0.099
        gate.step_done(None)                                     # N done
    assert gate.decider.prefill.compute_s(0, 1000) == pytest.approx(0.1, rel=0.05)


def test_sync_result_belongs_to_the_latest_step():
    """A step that scheduled nothing (a request waiting for L3) reports only
    if a worker had something to say; synchronously, a result is always the
    latest step's."""
    clock = FakeClock(100.0)
    gate = LoadGate("auto", 1 << 16, clock=clock)
    gate.step_planned(output({}), False)       # nothing scheduled, no report
    clock.now += 0.5
    gate.step_planned(output({"a": (1000, 0)}), False)
    clock.now += 0.1
    gate.step_done(None)
    assert not gate.pipelined and not gate._outstanding
    assert gate.decider.prefill.samples == 1
    assert gate.decider.prefill._snt == pytest.approx(1.0 * 0.1)  # N/1000 x 0.1 s


def test_pipelined_step_without_forward_makes_pairing_start_over():
    clock = FakeClock(100.0)
    gate = LoadGate("auto", 1 << 16, clock=clock)
    gate.step_planned(output({"a": (1000, 0)}), False)
    gate.step_planned(output({"b": (1000, 0)}), False)   # before a's result: a batch queue
    assert gate.pipelined
    clock.now += 0.1
    gate.step_done(None)                                  # a's
    gate.step_planned(output({}), False)                  # may not report
    clock.now += 0.1
    gate.step_done(None)                                  # b's, or the empty step's?
    assert gate.decider.prefill.samples == 1 and not gate._outstanding


def test_decode_steps_and_steps_that_load_are_not_samples():
    clock = FakeClock(100.0)
    gate = LoadGate("auto", 1 << 16, clock=clock)
    gate.step_planned(output({}, decodes=64), False)           # decode only
    gate.step_planned(output({"a": (20, 0)}, decodes=64), False)  # mostly decode
    gate.step_planned(output({"b": (2048, 0)}), copies_in_forward=True)
    for _ in range(3):
        clock.now += 0.1
        gate.step_done(None)
    assert gate.decider.prefill.samples == 0


def test_mixed_step_counts_every_tokens_attention():
    clock = FakeClock(100.0)
    gate = LoadGate("auto", 1 << 16, clock=clock)
    gate.step_planned(output({"a": (1000, 24)}, decodes=8), False)
    planned = gate._outstanding[0]
    assert planned.sample and planned.num_tokens == 1008
    assert planned.attn_pairs == attention_pairs(1000, 24) + 8 * attention_pairs(1, 100)


def test_workers_transfers_feed_the_bandwidths():
    gate = LoadGate("auto", 1 << 16)
    for _ in range(3):
        gate.step_done(stats(load=(8e9, 1.0), prefetch=(2e8, 1.0)))
    est = gate.decider.estimates()
    assert est["L2"] == pytest.approx(8e9) and est["L3"] == pytest.approx(2e8)
    gauges = gate.gauge_samples()
    assert gauges[key("estimated_bandwidth_bytes_per_second", "L2")] == 8e9


def test_always_measures_nothing_and_counts_decisions():
    gate = LoadGate("always", 1 << 16)
    gate.step_planned(output({"a": (1000, 0)}), False)
    gate.step_done(stats(load=(8e9, 1.0)))
    assert gate.decider.estimates() == {} and gate.gauge_samples() == {}
    gate.record("L2", True, 64)
    gate.record("L2", False, 32)
    gate.record("L3", False, 0)
    assert gate.counter_samples() == {key("load_decisions", "L2", "loaded"): 64,
                                      key("load_decisions", "L2", "declined"): 32}
