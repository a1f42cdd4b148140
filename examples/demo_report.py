"""What `make demo` shows on the terminal: vLLM's own output goes to a log
file, the demo's table and verdict to the screen (examples/offline_multiturn.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import TextIO


@dataclass(frozen=True)
class Terminal:
    out: TextIO
    err: TextIO
    log_path: Path | None  # None: nothing is redirected (VERBOSE=1)

    def fail(self, what: str) -> None:
        """Say what failed, with the end of vLLM's log (where the cause is)."""
        print(f"\ndemo failed: {what}", file=self.err)
        if self.log_path is None:
            return
        print(f"last lines of {self.log_path}:", file=self.err)
        lines = self.log_path.read_text(errors="replace").splitlines()[-25:]
        for line in lines:
            print("  " + line[:200], file=self.err)


def open_terminal(log_path: Path, verbose: bool) -> Terminal:
    """Redirect fds 1 and 2 to ``log_path`` unless ``verbose``.

    At the fd level, not sys.stdout: vLLM's loggers, C++ warnings and progress
    bars all write to the process's fds, from every thread."""
    if verbose:
        return Terminal(sys.stdout, sys.stderr, None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    err = os.fdopen(os.dup(2), "w", buffering=1)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return Terminal(out, err, log_path)


@dataclass(frozen=True)
class TurnRow:
    """One turn, all users: tokens summed, TTFT the median of the requests
    (robust to a request slowed by another process on a shared machine)."""

    turn: int
    prompt_tokens: int
    l1_tokens: int
    l2_tokens: int
    l3_tokens: int
    ttft_hicache_s: float
    ttft_without_s: float

    @property
    def speedup(self) -> float:
        return self.ttft_without_s / self.ttft_hicache_s


_HEAD = (
    f"{'prompt':>14}{'cached prompt tokens':^24}{'time to first token':^29}".rstrip() + "\n"
    f"{'turn':>6}{'tokens':>8}{'L1':>8}{'L2':>8}{'L3':>8}"
    f"{'HiCache':>10}{'without':>9}{'speed-up':>10}"
)


def print_table(out: TextIO, rows: Sequence[TurnRow], users: int) -> None:
    print(_HEAD, file=out)
    for r in rows:
        print(f"{r.turn:6d}{r.prompt_tokens:8,d}{r.l1_tokens:8,d}{r.l2_tokens:8,d}{r.l3_tokens:8,d}"
              f"{_ms(r.ttft_hicache_s):>10}{_ms(r.ttft_without_s):>9}{r.speedup:9.1f}x", file=out)
    print(f"tokens: sum over the {users} users' prompts of the turn. time to first token:\n"
          "median of the turn's requests, from vLLM's RequestOutput.metrics (arrival\n"
          "to first token); speed-up = without / HiCache.", file=out)


def summary(rows: Sequence[TurnRow], ttft_hicache_s: Sequence[float],
            ttft_without_s: Sequence[float], cached_without: int) -> str:
    """One line: TTFT over every request, and how much of the prompts was cached."""
    with_s, without_s = median(ttft_hicache_s), median(ttft_without_s)
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.l1_tokens + r.l2_tokens + r.l3_tokens for r in rows)
    return (f"HiCache: first token in {_ms(with_s)} vs {_ms(without_s)} without (median), "
            f"speed-up {without_s / with_s:.1f}x; {cached / prompt:.0%} of prompt tokens cached "
            f"vs {cached_without / prompt:.0%}")


def plot(rows: Sequence[TurnRow], path: Path) -> bool:
    """TTFT per turn as a PNG, only where matplotlib is already installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    turns = [r.turn for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(turns, [r.ttft_without_s * 1e3 for r in rows], "o-", label="without HiCache")
    ax.plot(turns, [r.ttft_hicache_s * 1e3 for r in rows], "o-", label="HiCache")
    ax.set(title="median time to first token per turn", xlabel="turn", ylabel="ms",
           xticks=turns, ylim=(0, None))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"
