"""benchmarks/bench_noreuse.py measures what it says: every request new
(nothing loaded), each hook's CPU and calls counted once per call, and the
L3 system's work found in our named background threads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_noreuse  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_thread_groups_drop_numbers_and_count_only_what_ran_meanwhile():
    before = {1: ("hicache-file", 1.0), 2: ("hicache-file", 2.0)}
    after = {1: ("hicache-file", 1.5), 2: ("hicache-file", 2.25), 3: ("hicache-l3", 0.5),
             4: ("idle", 0.0)}
    assert bench_noreuse.thread_delta(before, after) == {"hicache-file": 0.75,
                                                         "hicache-l3": 0.5}


def test_a_no_reuse_run_of_l2_and_l3_counts_hooks_and_background_threads(tiny_model_dir):
    args = argparse.Namespace(model=str(tiny_model_dir), requests=6, prompt_tokens=64,
                              output_tokens=2, concurrency=3, max_batched=256,
                              warm_store="")
    out = bench_noreuse.run_system(args, "l2l3", seed=0, profile=False)
    hooks = out["hooks"]
    assert out["loaded"] == 0  # no-reuse traffic: nothing came from L2 or L3
    assert hooks.calls["sched.on_new_request"] == 6
    assert hooks.calls["sched.get_num_new_matched_tokens"] >= 6
    assert hooks.calls["worker.wait_for_save"] == out["steps"] + 5  # + the ack steps
    assert all(s >= 0 for s in hooks.cpu_s.values())
    # The L3 lookup ran on its thread and the backups on the L3 write and file
    # threads (no read runs: nothing is reused).
    assert {"hicache-lookup", "hicache-l3w"} <= set(out["threads"])


def test_an_unknown_system_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_noreuse.py", "--systems", "l2,l4"])
    with pytest.raises(SystemExit):
        bench_noreuse.main()
    assert "unknown system 'l4'" in capsys.readouterr().err
