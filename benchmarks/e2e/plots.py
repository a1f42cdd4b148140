"""PNG plots of an end-to-end run (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from e2e.report import (  # noqa: E402
    _phase,
    _systems,
    bench_stats,
    bench_workloads,
    round_stats,
    session_stats,
    session_workloads,
    tier_split,
)

COLORS = {"vllm": "#7f7f7f", "ideal": "#2ca02c", "hicache-l2": "#1f77b4",
          "hicache-l2l3": "#ff7f0e", "hicache-l3": "#d62728"}
TIER_COLORS = {"L1": "#2ca02c", "L2": "#1f77b4", "L3": "#ff7f0e"}


def plot_all(results: dict, out: Path) -> list[Path]:
    return [p for p in (ttft_per_round(results, out), hit_rates(results, out),
                        throughput(results, out)) if p is not None]


def ttft_per_round(results: dict, out: Path) -> Path | None:
    # Only workloads that ran (--skip leaves the others without phases).
    workloads = [w for w in session_workloads(results)
                 if any(_phase(results, s, w) for s in _systems(results))]
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for s in _systems(results):
            phase = _phase(results, s, w)
            if not phase:
                continue
            rounds = round_stats(phase)
            x = [r["round"] for r in rounds]
            ax.plot(x, [r["ttft"]["mean"] for r in rounds], marker="o", color=COLORS[s],
                    label=f"{s} (mean)")
            ax.plot(x, [r["ttft"]["p90"] for r in rounds], linestyle=":", color=COLORS[s],
                    alpha=0.7)
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("TTFT, ms (solid: mean, dotted: p90)")
        ax.set_title(w)
        ax.set_xticks(x)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Time to first token per round")
    fig.tight_layout()
    path = out / "bench_serve_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _hit_rows(results: dict) -> list[tuple[str, str, dict, float]]:
    rows = []
    for w in session_workloads(results) + bench_workloads(results):
        if w.startswith("random") or "#" in w:
            continue
        for s in _systems(results):
            phase = _phase(results, s, w)
            if phase and "requests" in phase:
                rows.append((w, s, tier_split(phase), session_stats(phase)["reusable"]))
            elif phase:
                b = bench_stats(results, s, w)
                rows.append((w, s, b["tiers"], b["reusable"]))
    return rows


def hit_rates(results: dict, out: Path) -> Path | None:
    rows = _hit_rows(results)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows) + 2), 4.5))
    x, labels, last = [], [], None
    for i, (w, s, split, reusable) in enumerate(rows):
        pos = i + (0.6 * len({r[0] for r in rows[:i + 1]}) - 0.6)
        x.append(pos)
        labels.append(s)
        bottom = 0.0
        for tier in ("L1", "L2", "L3"):
            ax.bar(pos, 100 * split[tier], bottom=bottom, color=TIER_COLORS[tier],
                   label=tier if i == 0 else None)
            bottom += 100 * split[tier]
        ax.hlines(100 * reusable, pos - 0.45, pos + 0.45, color="black",
                  label="reusable (perfect cache)" if i == 0 else None)
        if w != last:
            ax.text(pos, 103, w, fontsize=9)
            last = w
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylim(0, 112)
    ax.set_ylabel("% of prompt tokens served from cache")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Cached prompt tokens per tier vs reusable", fontsize=11)
    fig.tight_layout()
    path = out / "bench_serve_hits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(results: dict, out: Path) -> Path | None:
    names = session_workloads(results) + [w for w in bench_workloads(results) if "#" not in w]
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 4), squeeze=False)
    for ax, w in zip(axes[0], names):
        systems, values = [], []
        for s in _systems(results):
            phase = _phase(results, s, w)
            if not phase:
                continue
            systems.append(s)
            if "requests" in phase:
                values.append(session_stats(phase)["tok_s"])
            else:
                values.append(bench_stats(results, s, w)["tok_s"])
        ax.bar(range(len(values)), values, color=[COLORS[s] for s in systems])
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(systems, rotation=45, ha="right", fontsize=8)
        ax.set_title(w, fontsize=10)
    fig.suptitle("Throughput (prompt + output tokens / s)")
    fig.tight_layout()
    path = out / "bench_serve_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
