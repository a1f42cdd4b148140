"""Reading logs (planner/log_format.py), the plan (report.py) and the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.planner.logs import BS, LogBuilder, blocks
from vllm_hicache.planner.__main__ import main
from vllm_hicache.planner.log_format import (
    Admit,
    LogReadError,
    read_log,
    read_logs,
)
from vllm_hicache.planner.report import CostModel, Sizing, build_plan

REPO = Path(__file__).resolve().parents[2]


def multiturn(num_convs: int = 6, turns: int = 4, dt_ms: int = 5000, **header) -> LogBuilder:
    """Conversations over one system prompt, one step per request, 5 s apart."""
    b = LogBuilder(**header)
    convs = {c: ["sys", f"c{c}"] for c in range(num_convs)}
    step = 0
    for turn in range(turns):
        for c in range(num_convs):
            convs[c] += [f"{c}u{turn}", f"{c}v{turn}"]
            b.request(blocks(*convs[c]), step=step, dt_ms=dt_ms)
            step += 1
    return b


def test_a_cut_log_keeps_its_whole_frames(tmp_path):
    path = multiturn().write(tmp_path / "log")
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    log = read_log(path)
    assert log.truncated and log.records == []  # the one record frame was cut
    assert read_logs([path]).truncated_files == [str(path)]


def test_not_a_log(tmp_path):
    (tmp_path / "x").write_bytes(b"hello world")
    with pytest.raises(LogReadError, match="not a HiCache access log"):
        read_log(tmp_path / "x")


def test_logs_of_two_servers_never_mix_their_requests(tmp_path):
    first = multiturn(started=100.0).write(tmp_path / "a")
    second = multiturn(started=200.0).write(tmp_path / "b")
    log = read_logs([first, second])
    admits = [r for r in log.records if isinstance(r, Admit)]
    assert len({r.seq for r in admits}) == len(admits) == 48
    assert log.num_writers == 2
    assert admits[24].t_ms == admits[0].t_ms + 100_000  # on the first file's clock


def test_sampled_logs_simulate_smaller_tiers():
    sizing = Sizing(LogBuilder(sample=0.25, page_bytes=1000, ranks=2).header)
    assert sizing.l2_pages(1.0) == 125_000  # 1 GB = 500k blocks of 2000 B, a quarter of them
    assert sizing.l2_gb(125_000) == pytest.approx(1.0)


def test_served_sizes_replay_and_a_sweep():
    """The sweep's largest L2 holds the log's whole footprint: it hits every
    reuse, which is what the reuse CDF says an unbounded cache would."""
    b = multiturn(l1_blocks=5, l2_pages=16)
    plan = build_plan(b.log(), CostModel())
    assert plan.served.l2_gb == pytest.approx(16 * 1000 / 1e9)
    largest = max(plan.sweep, key=lambda p: (p.l2_gb, p.l3_gb or 0))
    assert largest.result.hit_rate == pytest.approx(plan.profile.max_hit_rate)
    assert plan.knee_gb is not None
    assert all(p.value_usd is not None for p in plan.sweep)  # 2 minutes of requests


def test_cli_prints_the_plan_text_only_without_matplotlib(tmp_path, capsys, monkeypatch):
    path = multiturn(l3_backend="file", l3_prefetch_policy="wait_complete",
                     l3_threshold_tokens=BS).write(tmp_path / "log")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert main([str(path), "--plots", str(tmp_path / "plots"), "--gpu-usd-hour", "4"]) == 0
    out = capsys.readouterr().out
    for line in ("measured by the server", "replay of those sizes", "L2 GB", "Reuse-distance CDF",
                 "Knee: beyond", "GPU $4/hour", "Best value", "matplotlib is not installed"):
        assert line in out, line
    assert not (tmp_path / "plots").exists()


def test_cli_plots_with_matplotlib(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = multiturn().write(tmp_path / "log")
    assert main([str(path), "--plots", str(tmp_path / "plots"), "--l2-gb", "0,1e-5",
                 "--l3-gb", "0,inf"]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "hit_rate.png", "reuse_cdf.png", "tokens_saved.png"]
    assert "  unlim " in capsys.readouterr().out


def test_module_entry_point(tmp_path):
    path = multiturn().write(tmp_path / "log")
    out = subprocess.run([sys.executable, "-m", "vllm_hicache.planner", str(path), "--no-plots"],
                         capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "HiCache capacity plan" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "vllm_hicache.planner", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert bad.returncode == 2 and "error:" in bad.stderr
