"""The end-to-end benchmark's L3 hit breakdown (benchmarks/e2e): what a
phase moved in the server's ``l3_hit_stage_seconds`` histogram becomes mean
milliseconds per stage, and a table row per system."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from e2e import prom, report  # noqa: E402

from vllm_hicache.l3.hit_stages import STAGES  # noqa: E402

NAME = "vllm:hicache_l3_hit_stage_seconds"


def metrics_text(hits: int, seconds_per_hit: float) -> str:
    lines = []
    for engine in ("0", "1"):  # two engines: summed
        for stage in STAGES:
            labels = f'engine="{engine}",model_name="demo",stage="{stage}"'
            lines.append(f"{NAME}_count{{{labels}}} {hits / 2}")
            lines.append(f"{NAME}_sum{{{labels}}} {hits / 2 * seconds_per_hit}")
            lines.append(f'{NAME}_bucket{{{labels},le="0.01"}} {hits / 2}')
        labels = f'engine="{engine}",model_name="demo"'
        # Half the hits admitted in the step of their read; a block failed per 2 hits.
        lines.append(f'vllm:hicache_prefetches_total{{{labels},event="same_step"}} {hits / 4}')
        lines.append(f"vllm:hicache_load_failed_blocks_total{{{labels}}} {hits / 4}")
        # 4 ms of the forward's wait per same-step hit.
        lines.append(f"vllm:hicache_l3_same_step_wait_seconds_total{{{labels}}} {hits / 4 * 0.004}")
    return "\n".join(lines)


def test_a_phase_reports_the_mean_of_each_stage_per_hit():
    before = prom.parse(metrics_text(hits=4, seconds_per_hit=0.001))
    after = prom.parse(metrics_text(hits=10, seconds_per_hit=0.002))
    moved = prom.delta(before, after)
    stages = prom.l3_stage_ms(moved)
    # (10 * 2 ms - 4 * 1 ms) over 6 hits
    assert stages["hits"] == 6
    assert stages["same_step"] == 3 and stages["failed_blocks"] == 3
    assert stages["same_step_wait"] == pytest.approx(4.0)
    assert all(stages[s] == pytest.approx(16 / 6) for s in STAGES)
    assert prom.l3_stage_ms({}) == {}  # no L3 hit, no row


def test_the_session_table_has_a_row_per_system_with_l3_hits(monkeypatch):
    moved = prom.delta({}, prom.parse(metrics_text(hits=2, seconds_per_hit=0.003)))
    phases = {"hicache-l3": {"metrics": moved}, "hicache-l2": {"metrics": {}}}
    monkeypatch.setattr(report, "_phase", lambda results, s, w: phases[s])
    lines = report.l3_stage_table({}, "docqa", ["hicache-l2", "hicache-l3"])
    rows = [line for line in lines if line.startswith("| hicache")]
    assert rows == ["| hicache-l3 | 2 | 1 | 4.0 | 1 | " + " | ".join(["3.0"] * len(STAGES))
                    + f" | {3.0 * (len(STAGES) - 1):.1f} |"]


def split_metrics(requests: int, ttft_s: float, queue_s: float, prefill_s: float) -> dict:
    return {"vllm:request_queue_time_seconds_count": requests,
            "vllm:time_to_first_token_seconds_sum": requests * ttft_s,
            "vllm:request_queue_time_seconds_sum": requests * queue_s,
            "vllm:request_prefill_time_seconds_sum": requests * prefill_s}


def test_the_server_split_has_rounds_2on_where_the_run_kept_them(monkeypatch):
    phases = {
        "hicache-l2": {"metrics": split_metrics(4, 1.0, 0.5, 0.4),
                       "metrics_rounds_2on": split_metrics(3, 0.06, 0.001, 0.05)},
        "hicache-l3": {"metrics": split_metrics(4, 1.1, 0.5, 0.5)},
        "vllm": {"metrics": {}},
    }
    monkeypatch.setattr(report, "_phase", lambda results, s, w: phases[s])
    lines = report.server_split_table({}, "docqa", list(phases))
    rows = [line for line in lines if line.startswith("| hicache")]
    assert rows == ["| hicache-l2 | 1000.0 | 500.0 | 400.0 | 60.0 | 1.0 | 50.0 |",
                    "| hicache-l3 | 1100.0 | 500.0 | 500.0 | - | - | - |"]
    del phases["hicache-l2"]["metrics_rounds_2on"]  # no run kept them: no such columns
    assert "rounds >= 2" not in "".join(report.server_split_table({}, "docqa", list(phases)))


def test_repeats_merge_their_rounds_2on_counters_only_if_every_repeat_kept_them():
    first = {"requests": [], "round_wall_s": [1.0], "hits": {"L2": 1.0},
             "metrics": {"a": 1.0}, "metrics_rounds_2on": {"a": 0.5}}
    second = dict(first, metrics_rounds_2on={"a": 0.25, "b": 1.0})
    results = {"systems": {"s": {"workloads": {"docqa": first, "docqa#2": second}}}}
    assert report._phase(results, "s", "docqa")["metrics_rounds_2on"] == {"a": 0.75, "b": 1.0}
    del second["metrics_rounds_2on"]
    assert "metrics_rounds_2on" not in report._phase(results, "s", "docqa")
