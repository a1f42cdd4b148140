"""L3 throughput of the ``nixl`` backend (POSIX plugin) vs raw NIXL and raw syscalls.

Objects are host-page sized: a 64-byte header buffer + one payload buffer,
as the connector writes them (the payloads live in a host pool handed to
``register_memory``; the headers are separate small arrays). Three engines
move the same bytes in the same run, rounds interleaved:

- ``backend``: ``NixlBackend.put`` / ``get`` (temp file + ``os.replace``,
  size checks, registration of the headers per call);
- ``raw nixl``: one NIXL POSIX agent, the same two descriptors per object
  (header at offset 0, payload at 64) in one batched request, files opened
  and registered per round; no header, temp file or size handling;
- ``pwritev``: ``os.pwritev`` / ``os.preadv`` of the same buffers, one file
  per object, for context.

Every write round goes to fresh files (the previous round's are removed
untimed); reads read the last round's files, so they come from the page
cache (no drop_caches: the machine is shared). Nothing is fsynced, but
``os.sync()`` runs (untimed) before every timed run, and the engines' order
rotates between rounds.
Ratio = backend MB/s / raw nixl MB/s (target >= 80%). MB = 1e6 bytes.

Run: .venv/bin/python benchmarks/bench_l3_nixl.py [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402
from vllm_hicache.storage.nixl.engine import import_nixl  # noqa: E402

HEADER = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="256x1048576,1024x65536",
                        help="comma-separated COUNTxPAYLOAD_BYTES")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--posix-params", default='{"use_aio": "true"}',
                        help="NIXL POSIX plugin parameters (JSON)")
    return parser.parse_args()


class Data:
    """n objects: headers (separate arrays) + payloads (rows of one pool), pre-faulted."""

    def __init__(self, n: int, payload: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.pool = rng.integers(0, 256, (n, payload), dtype=np.uint8)
        self.headers = [rng.integers(0, 256, HEADER, dtype=np.uint8) for _ in range(n)]

    def objects(self) -> list[list[np.ndarray]]:
        return [[h, p] for h, p in zip(self.headers, self.pool)]

    def zero(self) -> None:
        self.pool[:] = 0
        for h in self.headers:
            h[:] = 0


class RawNixl:
    def __init__(self, params: dict, src: Data, dst: Data) -> None:
        api = import_nixl()
        conf = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self.agent = api.nixl_agent(f"raw-{uuid.uuid4().hex[:8]}", conf)
        self.agent.create_backend("POSIX", params)
        for d in (src, dst):
            regions = [(d.pool.ctypes.data, d.pool.nbytes, 0, "")]
            regions += [(h.ctypes.data, HEADER, 0, "") for h in d.headers]
            self.agent.register_memory(regions, "DRAM")

    def run(self, op: str, paths: list[str], data: Data) -> None:
        flags = os.O_WRONLY | os.O_CREAT if op == "WRITE" else os.O_RDONLY
        fds = [os.open(p, flags, 0o644) for p in paths]
        reg = self.agent.register_memory([(0, 0, fd, "") for fd in fds], "FILE")
        local, remote = [], []
        for fd, h, p in zip(fds, data.headers, data.pool):
            local += [(h.ctypes.data, HEADER, 0), (p.ctypes.data, p.nbytes, 0)]
            remote += [(0, HEADER, fd), (HEADER, p.nbytes, fd)]
        handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote, "FILE"),
                                            self.agent.name)
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        assert state == "DONE", state
        self.agent.release_xfer_handle(handle)
        self.agent.deregister_memory(reg)
        for fd in fds:
            os.close(fd)


def syscall_run(op: str, paths: list[str], data: Data) -> None:
    for path, obj in zip(paths, data.objects()):
        if op == "WRITE":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwritev(fd, obj, 0)
        else:
            fd = os.open(path, os.O_RDONLY)
            os.preadv(fd, obj, 0)
        os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def files_run(engine_run, paths: list[str]):
    return lambda op, data: engine_run(op, paths, data)


def backend_run(backend, keys: list[str]):
    def run(op: str, data: Data) -> None:
        call = backend.put if op == "WRITE" else backend.get
        ok = call(keys, data.objects())
        assert all(ok), f"backend {op}: {ok.count(False)} of {len(ok)} failed"
    return run


def bench_shape(n: int, payload: int, rounds: int, scratch: Path, params: dict) -> dict:
    """Median MB/s per (engine, op)."""
    scratch.mkdir()
    src, dst = Data(n, payload, 1), Data(n, payload, 2)
    backend = create_backend("nixl", {"path": str(scratch / "backend"),
                                      "posix_backend_params": params},
                             StorageContext("worker", 0, 1, HEADER + payload))
    for d in (src, dst):
        backend.register_memory(d.pool.reshape(-1))
    raw = RawNixl(params, src, dst)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        keys = [f"hc1-bench-{r}-{i:05d}" for i in range(n)]
        backend.clear()  # untimed: every write round creates fresh files
        for name in ("raw", "sys"):
            shutil.rmtree(scratch / f"{name}{r - 1}", ignore_errors=True)
            (scratch / f"{name}{r}").mkdir()
        runs = {
            "raw nixl": files_run(raw.run, [str(scratch / f"raw{r}" / k) for k in keys]),
            "backend": backend_run(backend, keys),
            "pwritev": files_run(syscall_run, [str(scratch / f"sys{r}" / k) for k in keys]),
        }
        order = list(runs)[r % 3:] + list(runs)[:r % 3]  # no engine always goes first
        for op, data in (("WRITE", src), ("READ", dst)):
            for engine in order:
                run = runs[engine]
                dst.zero()
                os.sync()  # untimed: nobody pays for another engine's dirty pages
                times.setdefault((engine, op), []).append(timed(lambda: run(op, data)))
                if op == "READ":
                    _verify(src, dst, engine)
    backend.close()
    nbytes = n * (HEADER + payload)
    return {key: nbytes / statistics.median(t) / 1e6 for key, t in times.items()}


def _verify(src: Data, dst: Data, engine: str) -> None:
    ok = np.array_equal(src.pool, dst.pool) and all(
        np.array_equal(a, b) for a, b in zip(src.headers, dst.headers))
    assert ok, f"{engine}: data read back differs"


def main() -> None:
    args = parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    params = json.loads(args.posix_params)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-l3-nixl-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"scratch: {scratch}  posix params: {params}  rounds: {args.rounds} (median shown)")
    print(f"{'objects':>16} {'op':>5} {'raw nixl':>9} {'backend':>9} {'ratio':>6} {'pwritev':>9}")
    try:
        for shape in args.shapes.split(","):
            n, payload = (int(x) for x in shape.split("x"))
            rows = bench_shape(n, payload, args.rounds, scratch / shape, params)
            for op in ("WRITE", "READ"):
                raw, ours = rows[("raw nixl", op)], rows[("backend", op)]
                label = f"{n} x {payload // 1024} KiB"
                print(f"{label:>16} {op:>5} {raw:9.0f} {ours:9.0f} {ours / raw:6.0%} "
                      f"{rows[('pwritev', op)]:9.0f}")
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
