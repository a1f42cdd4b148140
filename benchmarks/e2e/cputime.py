"""CPU time a server spent, by process and by HiCache thread, from /proc.

Throughput on a busy 2-core machine moves by several percent between
identical runs; the CPU seconds each process of a server spends per request
move far less, so a difference between two systems' CPU time says where a
small throughput gap could come from (and a gap with no CPU difference is
not our threads' work).

A snapshot maps ``process/thread`` to CPU seconds (user + system):
``process`` is vLLM's process title (``EngineCore``, ``Worker``...; the
server's own process is ``APIServer``), ``thread`` is ``all`` for the whole
process (threads that ended included), ``main`` for its main thread (in the
worker: the forward pass's Python and our hooks in it) or a named HiCache thread group
(``hicache-l3``: the native thread names the package sets, numbers dropped).
Linux only.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_THREAD_NUMBER = re.compile(r"[-_]\d*$")  # the kernel may cut "-0" to "-"


def _stat_cpu_s(stat_path: Path) -> float:
    """utime + stime of a /proc stat file (fields 14 and 15; the command name
    in parentheses may hold spaces, so count from its closing parenthesis)."""
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _process_role(pid: int, root_pid: int) -> str:
    if pid == root_pid:
        return "APIServer"
    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    if "::" in title:  # vLLM's setproctitle: "VLLM::EngineCore"
        return title.split("::", 1)[1].split()[0]
    return Path(title).name or "?"


def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            stack.extend(int(c) for c in task.read_text().split())
    return found


def snapshot(root_pid: int) -> dict[str, float]:
    """CPU seconds so far of the server whose main process is ``root_pid``
    and of everything it started. Processes that exit between two snapshots
    drop out (vLLM's stay for the server's life)."""
    seconds: defaultdict[str, float] = defaultdict(float)
    for pid in _descendants(root_pid):
        try:
            role = _process_role(pid, root_pid)
            seconds[f"{role}/all"] += _stat_cpu_s(Path(f"/proc/{pid}/stat"))
            seconds[f"{role}/main"] += _stat_cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))
            for task in Path(f"/proc/{pid}/task").iterdir():
                name = (task / "comm").read_text().strip()
                if name.startswith("hicache"):
                    seconds[f"{role}/{_THREAD_NUMBER.sub('', name)}"] += _stat_cpu_s(
                        task / "stat")
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
    return dict(seconds)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, per key."""
    return {k: after[k] - before.get(k, 0.0) for k in after}
