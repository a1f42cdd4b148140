"""Host memory of a set of processes, as the kernel accounts it.

PSS (proportional set size, ``/proc/PID/smaps_rollup``) divides every
shared page among the processes that map it, so summing PSS over the
instances of a machine counts a node-tier page once however many instances
mapped it, and a private L2 page once per instance that holds it: the sum
is what the machine spends. A process's children (none for vLLM's
in-process engine, but an executor may start some) are counted with it.
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_rollup_kib(text: str) -> dict[str, int]:
    """``Name: N kB`` lines of smaps_rollup -> {name: KiB}; other lines skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
            out[name.strip()] = int(fields[0])
    return out


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and every process below it (gone ones skipped)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        try:
            tasks = os.listdir(proc / str(p) / "task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = (proc / str(p) / "task" / tid / "children").read_text().split()
            except OSError:
                continue
            todo += [int(c) for c in children if int(c) not in seen]
    return seen


def pss_bytes(pids: list[int], proc: Path = Path("/proc")) -> int:
    """Summed PSS of ``pids`` and their descendants; ValueError when a
    process's rollup cannot be read (a benchmark must not count 0 for it)."""
    total = 0
    for root in pids:
        for pid in descendants(root, proc):
            path = proc / str(pid) / "smaps_rollup"
            try:
                fields = parse_rollup_kib(path.read_text())
            except OSError as exc:
                if pid == root:
                    raise ValueError(f"cannot read {path}: {exc}") from None
                continue  # a child that ended meanwhile
            if "Pss" not in fields:
                raise ValueError(f"{path} has no Pss line")
            total += fields["Pss"] * 1024
    return total


def allocated_bytes(directory: str) -> int:
    """Bytes a (tmpfs) directory tree holds: its files' allocated blocks,
    mapped by a process or not."""
    total = 0
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total
