"""Cost of sealing L3 objects (storage_secret / storage_encrypt) on the
``file`` backend's read and write paths.

The path measured is the worker's: ``PageStore.write`` / ``PageStore.read``
of host pages (``page_first`` pool: payloads move zero copy) through a
``FileBackend`` (4 I/O threads), with each codec:

    none          no check at all (a stand-in codec: the floor of the path)
    checksum      xxh3-128, what runs without a secret
    gmac          AES-256-GMAC, what runs with storage_secret (objects of a
                  batch checked on up to 4 threads: OpenSSL releases the GIL)
    gmac-1t       the same on the calling thread only
    mac-blake3    keyed BLAKE3, the MAC before GMAC (up to 4 threads too)
    mac-blake2b   keyed blake2b (hashlib), one thread
    aead          AES-256-GCM, what runs with storage_encrypt

and the raw engine on the same bytes in the same run: one file per object,
``os.open`` + ``os.writev`` + ``close`` / ``os.open`` + ``os.preadv`` +
``close``, one thread (as benchmarks/bench_l3_file.py). Every write makes
new files (both stores are emptied first, untimed, then ``os.sync()``), every
read is verified (a read that does not return every page aborts the run).
Samples rotate over the variants; the median is reported. Columns: MB/s, %
of the same path with ``checksum`` (the path without a secret), % of raw.
Target: >= 80% of raw. Cold reads (page cache dropped before each sample)
need root.

Run: .venv/bin/python benchmarks/bench_l3_seal.py [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.host import HostKVPool  # noqa: E402
from vllm_hicache.keys import KeyNamespace  # noqa: E402
from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402
from vllm_hicache.storage import format as fmt  # noqa: E402
from vllm_hicache.storage.pages import PageStore  # noqa: E402
from vllm_hicache.storage.sealing import (  # noqa: E402
    AeadCodec,
    ChecksumCodec,
    MacCodec,
    ObjectCodec,
)
from vllm_hicache.storage_secret import StorageSecret  # noqa: E402

# (pages, layers): pages of 64 KiB x layers (2 planes x 16 tokens x 8 heads x
# 128 x fp16 = 64 KiB per layer): 256 x 1 MiB and 1024 x 64 KiB.
SHAPES = ((256, 16), (1024, 1))
DROP_CACHES = "/proc/sys/vm/drop_caches"
SECRET = StorageSecret(os.urandom(32))


class NullCodec(ObjectCodec):
    """No check: the cost of the path itself."""

    protection, name = fmt.CHECKSUM, "none"

    def seal(self, key, payload, header, scratch=None):
        header[:] = 0
        return payload

    def open(self, key, header, body, payload, scratch=None):
        return True


class OneThreadMacCodec(MacCodec):
    name = "gmac-1t"
    releases_gil = False  # PageStore checks the batch on the calling thread


class Blake3MacCodec(ObjectCodec):
    """A keyed-hash MAC over the header fields and the payload (no nonce):
    the alternatives to GMAC, for comparison only."""

    protection, name, releases_gil = fmt.MAC, "mac-blake3", True

    def __init__(self, secret: StorageSecret) -> None:
        self._key = secret.derive("bench-mac")

    def _mac(self, fields: bytes, payload: np.ndarray) -> bytes:
        h = blake3(fields, key=self._key)
        h.update(memoryview(payload))
        return h.digest(fmt.CHECK_BYTES)

    def seal(self, key, payload, header, scratch=None):
        fields = fmt.pack_fields(key, payload.nbytes, self.protection)
        header[:fmt.FIELD_BYTES] = np.frombuffer(fields, np.uint8)
        header[fmt.FIELD_BYTES:] = np.frombuffer(self._mac(fields, payload), np.uint8)
        return payload

    def open(self, key, header, body, payload, scratch=None):
        if fmt.fields_nonce(header, key, payload.nbytes, self.protection) is None:
            return False
        expected = self._mac(header[:fmt.FIELD_BYTES].tobytes(), payload)
        return hmac.compare_digest(header[fmt.FIELD_BYTES:].tobytes(), expected)


class Blake2bMacCodec(Blake3MacCodec):
    name, releases_gil = "mac-blake2b", False

    def _mac(self, fields, payload):
        h = hashlib.blake2b(fields, key=self._key, digest_size=fmt.CHECK_BYTES)
        h.update(memoryview(payload))
        return h.digest()


CODECS = {
    "none": NullCodec(), "checksum": ChecksumCodec(), "gmac": MacCodec(SECRET),
    "gmac-1t": OneThreadMacCodec(SECRET), "mac-blake3": Blake3MacCodec(SECRET),
    "mac-blake2b": Blake2bMacCodec(SECRET), "aead": AeadCodec(SECRET),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold-rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch parent directory (default: $TMPDIR)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated subset")
    return parser.parse_args()


def drop_caches() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("1")


class Setup:
    """One pool (sources in the first half, read targets in the second), a
    PageStore per codec on one directory each, and the raw engine's files."""

    def __init__(self, scratch: str, num_pages: int, layers: int, codecs: list[str]):
        self.n = num_pages
        self.pool = HostKVPool(2 * num_pages, layers, 2, 16, 8, 128, torch.float16, "page_first",
                               pin_memory=False)
        self.pool.buffer.view(torch.int16).random_()
        self.hashes = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(num_pages)]
        self.src, self.dst = list(range(num_pages)), list(range(num_pages, 2 * num_pages))
        ctx = StorageContext("worker", 0, 1, fmt.HEADER_BYTES + self.pool.bytes_per_page)
        ns = KeyNamespace("bench/model", "float16", "page_first", 16, 1, 0)
        self.stores = {
            name: PageStore(create_backend("file", {"path": f"{scratch}/{name}"}, ctx), self.pool,
                            ns, CODECS[name])
            for name in codecs
        }
        self.raw_dir = f"{scratch}/raw"
        os.makedirs(self.raw_dir, exist_ok=True)
        header = np.zeros(fmt.HEADER_BYTES, np.uint8)
        as_bytes = lambda p: self.pool.page_run(p).view(torch.uint8).numpy()  # noqa: E731
        self.raw_src = [[header, as_bytes(p)] for p in self.src]
        self.raw_dst = [[np.empty_like(header), as_bytes(p)] for p in self.dst]

    @property
    def mb(self) -> float:
        return self.n * (fmt.HEADER_BYTES + self.pool.bytes_per_page) / 1e6

    def raw_write(self) -> None:
        for i, bufs in enumerate(self.raw_src):
            fd = os.open(f"{self.raw_dir}/raw-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.writev(fd, bufs)
            os.close(fd)

    def raw_read(self) -> None:
        for i, bufs in enumerate(self.raw_dst):
            fd = os.open(f"{self.raw_dir}/raw-{i}", os.O_RDONLY)
            os.preadv(fd, bufs, 0)
            os.close(fd)

    def clear(self, name: str) -> None:
        """Untimed, before a write: no file of this variant left."""
        if name == "raw":
            for i in range(self.n):
                try:
                    os.unlink(f"{self.raw_dir}/raw-{i}")
                except FileNotFoundError:
                    pass
        else:
            self.stores[name].backend.clear()
        os.sync()

    def write(self, name: str) -> None:
        assert all(self.stores[name].write(self.hashes, self.src))

    def read(self, name: str) -> None:
        got = self.stores[name].read(self.hashes, self.dst)
        assert got == self.n, (name, got)

    def close(self) -> None:
        for store in self.stores.values():
            store.backend.clear()
            store.backend.close()
        shutil.rmtree(self.raw_dir, ignore_errors=True)


def codec_calls(name: str, size: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(seal, open) of one in-memory page of ``size`` random bytes with codec
    ``name``; open checks the page sealed here, so a failed check raises."""
    codec = CODECS[name]
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = np.empty(size, np.uint8)
    extra = codec.scratch_bytes(size)
    scratch = np.empty(extra, np.uint8) if extra else None
    header = np.empty(fmt.HEADER_BYTES, np.uint8)
    body = codec.seal("k", payload, header, scratch)
    target = out if scratch is None else body

    def seal() -> None:
        codec.seal("k", payload, header, scratch)

    def open_() -> None:
        assert codec.open("k", header, target, out if scratch is not None else payload, scratch)

    return seal, open_


def primitive_speeds(codecs: list[str]) -> None:
    """GB/s of each codec's seal and open of one page in memory, one thread:
    the primitive alone (best of 5 runs of 64 MiB)."""
    print(f"{'page':>8} {'codec':<14} {'seal GB/s':>10} {'open GB/s':>10}")
    for size in (64 << 10, 1 << 20, 4 << 20):
        reps = max(1, (64 << 20) // size)
        for name in codecs:
            speeds = []
            for fn in codec_calls(name, size):
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    best = min(best, time.perf_counter() - start)
                speeds.append(reps * size / best / 1e9)
            print(f"{size >> 10:>5} KiB {name:<14} {speeds[0]:>10.2f} {speeds[1]:>10.2f}")
    print()


def timed(before, fn, *args) -> float:
    before()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(setup: Setup, rounds: int, cold_rounds: int) -> dict[tuple[str, str], list[float]]:
    """(op, variant) -> seconds per sample; variants rotate within a round."""
    samples: dict[tuple[str, str], list[float]] = {}
    variants = ["raw", *setup.stores]

    def run(op: str, variant: str, before) -> None:
        if variant == "raw":
            fn = setup.raw_write if op == "write" else setup.raw_read
            seconds = timed(before, fn)
        else:
            fn = setup.write if op == "write" else setup.read
            seconds = timed(before, fn, variant)
        samples.setdefault((op, variant), []).append(seconds)

    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            run("write", variant, lambda v=variant: setup.clear(v))
        for variant in order:
            run("read (cache)", variant, os.sync)
    for r in range(cold_rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            run("read (cold)", variant, drop_caches)
    return samples


def main() -> None:
    args = parse_args()
    codecs = args.codecs.split(",")
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        raise SystemExit(f"unknown codecs {unknown}; accepted: {list(CODECS)}")
    print("command:", shlex.join([sys.executable, *sys.argv]))
    scratch = tempfile.mkdtemp(prefix="bench_l3_seal-", dir=args.dir)
    cold = args.cold_rounds if os.access(DROP_CACHES, os.W_OK) else 0
    print(f"scratch: {scratch}; CPUs: {os.cpu_count()}; torch threads: "
          f"{torch.get_num_threads()}; cold reads: {'yes' if cold else 'no (needs root)'}")
    primitive_speeds(codecs)
    header = (f"{'objects':>13} {'op':<12} {'variant':<13} {'MB/s':>7} {'vs checksum':>12} "
              f"{'vs raw':>7}")
    print(header + "\n" + "-" * len(header))
    try:
        for num_pages, layers in SHAPES:
            setup = Setup(scratch, num_pages, layers, codecs)
            try:
                samples = measure(setup, args.rounds, cold)
            finally:
                setup.close()
            size = f"{num_pages} x {setup.pool.bytes_per_page >> 10} KiB"
            for op in ("write", "read (cache)", "read (cold)"):
                if (op, "raw") not in samples:
                    continue
                raw = statistics.median(samples[(op, "raw")])
                base = statistics.median(samples.get((op, "checksum"), [float("nan")]))
                for variant in ["raw", *codecs]:
                    s = statistics.median(samples[(op, variant)])
                    vs_base = "" if variant == "raw" else f"{base / s:.0%}"
                    print(f"{size:>13} {op:<12} {variant:<13} {setup.mb / s:>7.0f} "
                          f"{vs_base:>12} {raw / s:>7.0%}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
