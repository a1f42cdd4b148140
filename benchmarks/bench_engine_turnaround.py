"""Does a background backup delay the engine's step turnaround?

vLLM's engine core and worker hand each step to each other through shared
memory and wait by spinning on ``sched_yield``. This reproduces that
hand-off on two cores, with nothing of vLLM's:

- a *worker* process on the compute core: "computes" ``--step-ms`` (a busy
  loop), then posts the step (a timestamp and a flag in shared memory) and
  spins with ``sched_yield`` until it is taken;
- an *engine* process on the other core: spins with ``sched_yield`` until a
  step is posted, records how long after the post it noticed (the
  turnaround delay), "schedules" ``--schedule-ms``, and takes it;
- in the ``backups`` cases, a *backup* process on the engine's core: the
  file L3's puts of one request's objects (``--objects`` of ``--object-bytes``
  every ``--every-ms``) on a background pool thread (``DaemonPool`` with
  ``l3/worker_io.BACKUPS``: ten nice steps down), as the worker half runs
  them: ``backups`` is the product's path (one put of the batch);
  ``backups-yielding`` puts the objects one at a time and yields the core
  after each (``os.sched_yield``), a variant tried and reverted (see
  docs/benchmarks.md: at ten nice steps down it starves the backups
  themselves when the core is contended).

Reported per case, median over ``--reps`` alternated runs of ``--seconds``:
steps handed over (the two processes' throughput) and the engine's delay in
noticing a step (mean, p99, max).

    .venv/bin/python benchmarks/bench_engine_turnaround.py [--dir /work/scratch]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.daemon_pool import DaemonPool  # noqa: E402
from vllm_hicache.l3.worker_io import BACKUPS  # noqa: E402
from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402

HEADER_BYTES = 64
CASES = ("none", "backups", "backups-yielding")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--schedule-ms", type=float, default=2.0)
    p.add_argument("--objects", type=int, default=34, help="objects per request's backup")
    p.add_argument("--object-bytes", type=int, default=96 << 10)
    p.add_argument("--every-ms", type=float, default=10.0, help="pause between two backups")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="the store's parent directory (default $TMPDIR)")
    return p.parse_args()


def cores() -> tuple[int, int]:
    """(the engine's core, the compute core): the first and last allowed."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("needs two cores")
    return allowed[0], allowed[-1]


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def worker(core: int, step_s: float, posted, flag, stop) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        busy(step_s)
        posted.value = time.perf_counter()
        flag.value = 1
        while flag.value == 1 and not stop.is_set():
            os.sched_yield()


def engine(core: int, schedule_s: float, posted, flag, stop, out) -> None:
    os.sched_setaffinity(0, {core})
    delays = []
    while not stop.is_set():
        if flag.value == 1:
            delays.append(time.perf_counter() - posted.value)
            busy(schedule_s)
            flag.value = 0
        else:
            os.sched_yield()
    out.put(delays)


def backups(core: int | None, args: argparse.Namespace, store: str, yields: bool,
            stop) -> None:
    """One request's backup after another until ``stop`` (on ``core``, if
    given); ``yields``: one object per put, the core yielded after each."""
    if core is not None:
        os.sched_setaffinity(0, {core})

    def one_by_one(keys: list[str], objects: list) -> list[bool]:
        stored = []
        for key, obj in zip(keys, objects):
            stored += backend.put([key], [obj])
            os.sched_yield()
        return stored

    write = one_by_one if yields else None
    backend = create_backend("file", {"path": store},
                             StorageContext("worker", 0, 1, HEADER_BYTES + args.object_bytes))
    pool = DaemonPool(1, "bench-l3w", BACKUPS)
    objects = [[np.zeros(HEADER_BYTES, np.uint8), np.ones(args.object_bytes, np.uint8)]]
    request = 0
    try:
        while not stop.is_set():
            keys = [f"r{os.getpid()}x{request}x{i}" for i in range(args.objects)]
            stored = pool.submit(write or backend.put, keys, objects * len(keys)).result(
                timeout=60)
            if not all(stored):
                raise RuntimeError("a put failed")
            request += 1
            time.sleep(args.every_ms / 1e3)
    finally:
        pool.shutdown()
        backend.close()


def run(case: str, args: argparse.Namespace, parent: str) -> tuple[int, np.ndarray]:
    engine_core, compute_core = cores()
    posted, flag = mp.Value("d", 0.0, lock=False), mp.Value("i", 0, lock=False)
    stop, out = mp.Event(), mp.Queue()
    procs = [
        mp.Process(target=worker, args=(compute_core, args.step_ms / 1e3, posted, flag, stop)),
        mp.Process(target=engine, args=(engine_core, args.schedule_ms / 1e3, posted, flag,
                                        stop, out)),
    ]
    if case != "none":
        store = tempfile.mkdtemp(dir=parent)
        procs.append(mp.Process(target=backups, args=(engine_core, args, store,
                                                      case == "backups-yielding", stop)))
    for p in procs:
        p.start()
    time.sleep(args.seconds)
    stop.set()
    delays = np.array(out.get(timeout=60)) * 1e3
    for p in procs:
        p.join(timeout=60)
    return len(delays), delays


def main() -> int:
    args = parse_args()
    parent = tempfile.mkdtemp(prefix="hicache-turnaround-", dir=args.dir)
    results: dict[str, list[tuple[int, float, float, float]]] = {c: [] for c in CASES}
    try:
        for _ in range(args.reps):
            for case in CASES:
                steps, ms = run(case, args, parent)
                results[case].append((steps, ms.mean(), np.percentile(ms, 99), ms.max()))
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    print(f"# {args.reps} x {args.seconds:.0f} s per case; step {args.step_ms} ms + schedule "
          f"{args.schedule_ms} ms; backups: {args.objects} x {args.object_bytes} B every "
          f"{args.every_ms} ms")
    base = statistics.median(r[0] for r in results["none"])
    for case, runs in results.items():
        steps = statistics.median(r[0] for r in runs)
        mean, p99, worst = (statistics.median(r[i] for r in runs) for i in (1, 2, 3))
        print(f"{case:17s} steps {steps:6.0f} ({steps / base:.3f} of none)  turnaround delay "
              f"ms: mean {mean:.3f}  p99 {p99:.3f}  max {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
