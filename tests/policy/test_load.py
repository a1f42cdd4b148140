"""Load decisions (policy/load.py): the estimators and the rule."""

from __future__ import annotations

import math

import pytest

from tests.conftest import make_config
from tests.fake_clock import FakeClock
from vllm_hicache.policy.load import (
    BandwidthEstimate,
    LoadDecider,
    PrefillModel,
    attention_pairs,
)

PAGE = 1 << 20  # 1 MiB pages


# --- bandwidth ---------------------------------------------------------------------


def test_bandwidth_is_cold_until_enough_samples_then_the_median():
    est = BandwidthEstimate(window=5, min_samples=3)
    est.observe(100e6, 1.0)
    est.observe(100e6, 1.0)
    assert not est.ready and est.bytes_per_s() is None
    est.observe(300e6, 1.0)
    assert est.bytes_per_s() == 100e6


def test_one_stalled_copy_does_not_move_the_bandwidth():
    est = BandwidthEstimate(window=9)
    for _ in range(8):
        est.observe(1e9, 0.01)       # 100 GB/s
    est.observe(1e6, 10.0)           # descheduled: 100 kB/s
    assert est.bytes_per_s() == pytest.approx(1e11)


def test_bytes_and_seconds_reported_in_different_steps_make_one_sample():
    """On CUDA a copy's seconds arrive after its bytes (timing events)."""
    est = BandwidthEstimate(min_samples=1)
    assert not est.observe(4e9, 0.0)
    assert not est.observe(0.0, 0.0)
    assert est.observe(0.0, 2.0)
    assert est.bytes_per_s() == pytest.approx(2e9)
    assert est.samples == 1


def test_bandwidth_follows_a_lasting_change():
    est = BandwidthEstimate(window=5)
    for _ in range(5):
        est.observe(1e9, 1.0)
    for _ in range(3):
        est.observe(1e7, 1.0)
    assert est.bytes_per_s() == pytest.approx(1e7)


# --- prefill --------------------------------------------------------------------------


def steps(model: PrefillModel, c_tok: float, c_attn: float, shapes) -> None:
    for n, ctx in shapes:
        a = attention_pairs(n, ctx)
        model.observe(n, a, c_tok * n + c_attn * a)


SHAPES = [(512, 0), (2048, 0), (2048, 2048), (1024, 6144), (256, 300), (2048, 8192)]


def test_prefill_model_recovers_the_per_token_and_attention_costs():
    model = PrefillModel()
    assert model.compute_s(0, 100) is None  # cold
    steps(model, 2e-5, 3e-9, SHAPES * 3)
    c_tok, c_attn = model.coefficients
    assert c_tok == pytest.approx(2e-5, rel=0.02)
    assert c_attn == pytest.approx(3e-9, rel=0.02)
    # A token deep in a context costs more than one at its start.
    assert model.compute_s(8192, 1024) > 2 * model.compute_s(0, 1024)
    assert model.tokens_per_s(1024) == pytest.approx(
        1024 / (2e-5 * 1024 + 3e-9 * attention_pairs(1024, 0)), rel=0.02)


def test_prefill_model_without_attention_cost_stays_non_negative():
    model = PrefillModel()
    steps(model, 1e-4, 0.0, SHAPES * 2)
    c_tok, c_attn = model.coefficients
    assert c_attn >= 0 and c_tok == pytest.approx(1e-4, rel=0.02)


def test_a_stalled_step_moves_the_fit_a_bounded_amount():
    model = PrefillModel()
    steps(model, 1e-4, 0.0, SHAPES * 3)
    before = model.compute_s(0, 1000)
    model.observe(1000, attention_pairs(1000, 0), 50.0)  # 500x its prediction
    assert model.compute_s(0, 1000) < 1.2 * before


def test_prefill_model_follows_a_lasting_slowdown():
    model = PrefillModel()
    steps(model, 1e-4, 0.0, SHAPES * 3)
    steps(model, 4e-4, 0.0, SHAPES * 12)
    assert model.compute_s(0, 1000) == pytest.approx(0.4, rel=0.1)


def test_steps_that_are_not_samples_are_ignored():
    model = PrefillModel(min_samples=1)
    model.observe(0, 0.0, 1.0)
    model.observe(100, 100.0, 0.0)
    model.observe(100, 100.0, 1e6)  # longer than any real step
    assert not model.ready


# --- the decision ---------------------------------------------------------------------


def warm(decider: LoadDecider, l2_bytes_per_s: float | None = None,
         l3_bytes_per_s: float | None = None, c_tok: float = 1e-4) -> None:
    steps(decider.prefill, c_tok, 0.0, SHAPES)
    for _ in range(3):
        if l2_bytes_per_s is not None:
            decider.observe_transfers(load=(l2_bytes_per_s, 1.0))
        if l3_bytes_per_s is not None:
            decider.observe_transfers(prefetch=(l3_bytes_per_s, 1.0))


def test_always_loads_everything():
    d = LoadDecider("always", PAGE)
    warm(d, l2_bytes_per_s=1.0, l3_bytes_per_s=1.0)
    assert d.load_l2(0, 1024, 64) and d.prefetch_l3(0, 1024, 64)


def test_cold_start_loads():
    d = LoadDecider("auto", PAGE)
    assert d.load_l2(0, 1024, 64) and d.prefetch_l3(0, 1024, 64)
    steps(d.prefill, 1e-4, 0.0, SHAPES)  # prefill known, bandwidth not yet
    assert d.load_l2(0, 1024, 64) and d.prefetch_l3(0, 1024, 64)


def test_loads_what_is_faster_than_computing_and_declines_the_rest():
    # 64 pages of 1 MiB for 1024 tokens at 0.1 ms/token: compute 0.1024 s.
    fast, slow = LoadDecider("auto", PAGE), LoadDecider("auto", PAGE)
    warm(fast, l2_bytes_per_s=10e9, l3_bytes_per_s=2e9)     # 7 ms, 34 ms
    warm(slow, l2_bytes_per_s=10e9, l3_bytes_per_s=200e6)   # 7 ms, 336 ms
    assert fast.load_l2(0, 1024, 64) and fast.prefetch_l3(0, 1024, 64)
    assert slow.load_l2(0, 1024, 64)
    assert not slow.prefetch_l3(0, 1024, 64)


def test_margin_lets_ties_load():
    d = LoadDecider("auto", PAGE, margin=0.2)
    warm(d, l2_bytes_per_s=64 * PAGE / 0.1024 / 1.1)   # load 1.1x compute: loaded
    assert d.load_l2(0, 1024, 64)
    d = LoadDecider("auto", PAGE, margin=0.2)
    warm(d, l2_bytes_per_s=64 * PAGE / 0.1024 / 1.3)   # 1.3x: declined
    assert not d.load_l2(0, 1024, 64)


def test_a_hit_deep_in_its_context_is_more_worth_loading():
    d = LoadDecider("auto", PAGE)
    steps(d.prefill, 1e-5, 1e-8, SHAPES * 3)
    for _ in range(3):
        d.observe_transfers(prefetch=(300e6, 1.0))
    # 64 pages take 0.22 s; 1024 tokens cost 0.02 s at context 0, 0.38 s at 32k.
    assert not d.prefetch_l3(0, 1024, 64)
    assert d.prefetch_l3(32768, 1024, 64)


def test_l3_time_includes_the_load_into_l1():
    d = LoadDecider("auto", PAGE)
    # L3 alone (64 MiB at 1 GB/s: 67 ms) beats computing (102 ms); with the
    # L2 -> L1 load at 1 GB/s too, it does not (134 ms > 1.2 x 102 ms).
    warm(d, l2_bytes_per_s=1e9, l3_bytes_per_s=1e9)
    assert not d.prefetch_l3(0, 1024, 64)
    assert d.load_l2(0, 1024, 64)


def test_a_stale_l2_estimate_lets_one_hit_through_per_interval():
    clock = FakeClock(0.0)
    d = LoadDecider("auto", PAGE, clock=clock, probe_interval_s=30.0)
    warm(d, l2_bytes_per_s=1e6)
    assert not d.load_l2(0, 1024, 64)
    clock.now = 31.0
    assert d.load_l2(0, 1024, 64)       # the probe
    assert not d.load_l2(0, 1024, 64)   # one per interval
    for _ in range(3):                  # the probe (and what follows) found it fast again
        d.observe_transfers(load=(1e12, 1.0))
    assert d.load_l2(0, 1024, 64)


def test_l3_asks_for_a_sample_once_per_interval_once_measured():
    clock = FakeClock(0.0)
    d = LoadDecider("auto", PAGE, clock=clock, l3_probe_interval_s=30.0)
    clock.now = 100.0
    assert not d.wants_l3_sample()  # never measured: nothing to refresh
    warm(d, l3_bytes_per_s=1e6)
    assert not d.wants_l3_sample()
    clock.now = 131.0
    assert d.wants_l3_sample() and not d.wants_l3_sample()


def test_estimates_appear_once_measured():
    d = LoadDecider("auto", PAGE)
    assert d.estimates() == {}
    warm(d, l2_bytes_per_s=5e9)
    est = d.estimates()
    assert est["L2"] == pytest.approx(5e9) and "L3" not in est
    assert math.isclose(est["prefill"], 1e4, rel_tol=0.02)


def test_unknown_mode_is_refused_and_the_config_parses_it():
    with pytest.raises(ValueError, match="hicache_load_decision"):
        LoadDecider("sometimes", PAGE)
    assert make_config().hicache_load_decision == "auto"
    assert make_config(hicache_load_decision="always").hicache_load_decision == "always"
    with pytest.raises(ValueError, match="hicache_load_decision"):
        make_config(hicache_load_decision="never")


def test_prefill_model_reset_forgets_the_fit_and_keeps_the_settings():
    model = PrefillModel(decay=0.5, min_samples=2, clip=3.0)
    steps(model, 2e-5, 3e-9, SHAPES)
    assert model.ready
    model.reset()
    assert (model.samples, model.ready, model.compute_s(0, 100)) == (0, False, None)
    assert (model.decay, model.min_samples, model.clip) == (0.5, 2, 3.0)
    steps(model, 1e-4, 0.0, SHAPES)
    assert model.coefficients[0] == pytest.approx(1e-4, rel=0.02)


def test_l3_time_includes_the_lookup_latency():
    d = LoadDecider("auto", PAGE)
    warm(d, l2_bytes_per_s=10e9, l3_bytes_per_s=2e9)
    # 4 pages for 64 tokens: 2.5 ms of bytes against 6.4 ms of compute.
    assert d.prefetch_l3(0, 64, 4)
    assert d.l3_latency_s() == 0.0
    for seconds in (0.02, 0.02, 5.0):  # the median: one stalled lookup does not count
        d.observe_l3_latency(seconds)
    assert d.l3_latency_s() == 0.02
    assert not d.prefetch_l3(0, 64, 4)        # a far store: recompute the short hit
    assert d.prefetch_l3(0, 1024, 64)         # a long one still pays
    d.observe_l3_latency(-1.0)                 # not a round trip: ignored
    assert d.l3_latency_s() == 0.02
