"""L3 throughput of the redis backend vs raw redis-py on the same bytes.

Starts a private redis-server (127.0.0.1 on a free port plus a unix socket in
a temporary directory, no persistence), then for each object size and
transport measures, interleaved repeat by repeat:

- raw: redis-py pipelines of SET of each object as one ready ``bytes``, and
  pipelines of GET returning ``bytes`` (no copy out): the engine's ceiling;
- ours: ``RedisBackend.put`` of (64 B header, payload) numpy buffers taken
  from a host-pool-like array (sent from that memory: no payload copy) and
  ``get`` into other buffers of that array (copies each reply: one copy).

Both use the same pipeline chunks (the backend's batch_size / batch_bytes).
Ratio = ours / raw; the target is >= 80%. MB/s are 1e6 B/s of objects, for
the median and for the best of the repeats (on a small shared VM the best is
the steadier figure: noise only ever adds time). Whether redis-py uses
hiredis (much faster replies, but its command packer copies every value) is
printed.

Run: .venv/bin/python benchmarks/bench_l3_redis.py [--repeats 7] [--cases 256x1048576,1024x65536]
(bounded: each case and transport moves its bytes 4 x repeats times; 15-40 s
with the defaults on a 2-core VM). The server listens on 127.0.0.1 only; to
keep it private, run it inside ``unshare -n sh -c 'ip link set lo up && ...'``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
from redis.utils import HIREDIS_AVAILABLE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.storage.redis.services import RedisServer  # noqa: E402
from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402
from vllm_hicache.storage.redis.config import RedisConfig  # noqa: E402

HEADER = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", default="256x1048576,1024x65536",
                        help="comma-separated COUNTxPAYLOAD_BYTES")
    parser.add_argument("--transports", default="tcp,unix")
    parser.add_argument("--batch-size", type=int, default=RedisConfig.batch_size)
    parser.add_argument("--batch-bytes", type=int, default=RedisConfig.batch_bytes)
    return parser.parse_args()


class Case:
    """``count`` objects of HEADER + ``payload`` bytes in a pool-like array."""

    def __init__(self, count: int, payload: int) -> None:
        self.count, self.payload = count, payload
        self.size = HEADER + payload
        # Source and target halves of one array, touched now: page faults on
        # first use would otherwise dominate the first repeat.
        self.pool = np.random.default_rng(0).integers(0, 256, 2 * count * self.size, np.uint8)
        self.keys = [f"bench-{count}x{payload}-{i:05d}" for i in range(count)]
        self.raw_values = [bytes(self.obj(i)) for i in range(count)]

    def obj(self, i: int, target: bool = False) -> np.ndarray:
        start = (i + target * self.count) * self.size
        return self.pool[start:start + self.size]

    def bufs(self, i: int, target: bool = False) -> list[np.ndarray]:
        whole = self.obj(i, target)
        return [whole[:HEADER], whole[HEADER:]]

    @property
    def megabytes(self) -> float:
        return self.count * self.size / 1e6


def chunks(case: Case, batch_size: int, batch_bytes: int) -> list[range]:
    per = max(1, min(batch_size, batch_bytes // case.size))
    return [range(s, min(s + per, case.count)) for s in range(0, case.count, per)]


def raw_put(client: redis.Redis, case: Case, ranges: list[range]) -> None:
    for r in ranges:
        pipe = client.pipeline(transaction=False)
        for i in r:
            pipe.set(f"raw:{case.keys[i]}", case.raw_values[i])
        assert all(pipe.execute())


def raw_get(client: redis.Redis, case: Case, ranges: list[range]) -> None:
    for r in ranges:
        pipe = client.pipeline(transaction=False)
        for i in r:
            pipe.get(f"raw:{case.keys[i]}")
        assert all(len(v) == case.size for v in pipe.execute())


def ours_put(backend, case: Case) -> None:
    assert all(backend.put(case.keys, [case.bufs(i) for i in range(case.count)]))


def ours_get(backend, case: Case) -> None:
    assert all(backend.get(case.keys, [case.bufs(i, True) for i in range(case.count)]))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_case(url: str, case: Case, args: argparse.Namespace) -> dict[str, list[float]]:
    options = {"url": url, "batch_size": args.batch_size, "batch_bytes": args.batch_bytes,
               "key_prefix": "ours:"}
    backend = create_backend("redis", options, StorageContext("worker", 0, 1, case.size))
    client = redis.Redis.from_url(url, socket_timeout=30)
    ranges = chunks(case, args.batch_size, args.batch_bytes)
    times: dict[str, list[float]] = {k: [] for k in ("raw put", "ours put", "raw get", "ours get")}
    try:
        ops = {
            "raw": (lambda: raw_put(client, case, ranges), lambda: raw_get(client, case, ranges)),
            "ours": (lambda: ours_put(backend, case), lambda: ours_get(backend, case)),
        }
        for rep in range(args.repeats):
            # Alternate who goes first: neither gets a systematically warmer server.
            order = ("raw", "ours") if rep % 2 == 0 else ("ours", "raw")
            for op_index, op in enumerate(("put", "get")):
                for who in order:
                    times[f"{who} {op}"].append(timed(ops[who][op_index]))
        for i in range(case.count):  # what came back is what went in
            assert np.array_equal(case.obj(i, True), case.obj(i))
        client.flushdb()
    finally:
        backend.close()
        client.close()
    return times


def row(case: Case, transport: str, op: str, times: dict[str, list[float]]) -> str:
    cells = []
    for stat in (statistics.median, min):
        raw = case.megabytes / stat(times[f"raw {op}"])
        ours = case.megabytes / stat(times[f"ours {op}"])
        cells.append(f"{raw:6.0f} {ours:6.0f} {ours / raw:6.0%}")
    label = f"{case.count} x {case.payload >> 10} KiB"
    return f"{label:>16} {transport:>9} {op:>4} |         {cells[0]} |       {cells[1]}"


def main() -> None:
    args = parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"redis-py {redis.__version__}, hiredis {'yes' if HIREDIS_AVAILABLE else 'no'}; "
          f"batch_size {args.batch_size}, batch_bytes {args.batch_bytes}, "
          f"{args.repeats} repeats")
    cases = [Case(*map(int, c.split("x"))) for c in args.cases.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        srv = RedisServer(Path(tmp), "--maxmemory", "3gb", "--maxmemory-policy", "allkeys-lru")
        srv.start()
        try:
            print(f"{srv.binary}: {srv.url} and {srv.unix_url}")
            print(f"{'objects':>16} {'transport':>9} {'op':>4} | median: {'raw':>6} {'ours':>6} "
                  f"{'ratio':>6} | best: {'raw':>6} {'ours':>6} {'ratio':>6}   (MB/s)")
            for case in cases:
                for transport in args.transports.split(","):
                    url = srv.url if transport == "tcp" else srv.unix_url
                    times = run_case(url, case, args)
                    for op in ("put", "get"):
                        print(row(case, transport, op, times))
        finally:
            srv.kill()


if __name__ == "__main__":
    main()
