"""PNG plots of a plan, with matplotlib (the ``bench`` extra). ``save_plots``
returns None, without raising, when matplotlib is not installed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from vllm_hicache.planner.model import ReplayResult
from vllm_hicache.planner.report import Plan, Sizing


def save_plots(plan: Plan, out_dir: str | Path) -> list[Path] | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_by_capacity(plt, plan, out, "hit_rate.png", "hit rate (% of prompt tokens)",
                          lambda r: 100 * r.hit_rate),
             _by_capacity(plt, plan, out, "tokens_saved.png",
                          "prefill tokens saved (L2 + L3 hits)", lambda r: r.saved_tokens),
             _reuse_cdf(plt, plan, out / "reuse_cdf.png")]
    return paths


def _l3_axis(plan: Plan) -> tuple[list[float], float]:
    """Finite L3 sizes, and where 'unlimited' is drawn (right of the largest)."""
    finite = sorted({p.l3_gb for p in plan.sweep if p.l3_gb is not None})
    top = max(finite) if finite and max(finite) > 0 else 1.0
    return finite, top * 2


def _by_capacity(plt: ModuleType, plan: Plan, out: Path, name: str, ylabel: str,
                 metric: Callable[[ReplayResult], float]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _, unlimited_x = _l3_axis(plan)
    for l2 in sorted({p.l2_gb for p in plan.sweep}):
        points = sorted(((unlimited_x if p.l3_gb is None else p.l3_gb), metric(p.result))
                        for p in plan.sweep if p.l2_gb == l2)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                label=f"L2 {l2:.3g} GB")
    ax.axvline(unlimited_x, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("L3 GB (dotted line: unlimited)")
    ax.set_ylabel(ylabel)
    ax.set_title("HiCache replay: " + ylabel.split(" (")[0])
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _reuse_cdf(plt: ModuleType, plan: Plan, path: Path) -> Path:
    sizing = Sizing(plan.header)
    cdf = plan.profile.cdf()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if cdf:
        xs = [sizing.l2_gb(c) for c, _ in cdf]
        ax.step(xs, [100 * y for _, y in cdf], where="post", label="ideal LRU (reuse CDF)")
        ax.set_xscale("log")
    if plan.knee_gb is not None:
        ax.axvline(plan.knee_gb, color="red", linestyle="--",
                   label=f"knee {plan.knee_gb:.3g} GB")
    ax.set_xlabel("cache size, GB of KV (distinct prefix data between reuses)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_title("Reuse-distance CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

