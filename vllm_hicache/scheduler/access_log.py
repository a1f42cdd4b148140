"""The access log (``hicache_access_log``): per request, when it arrived, its
chain of block hashes, its prompt tokens and where its hit came from (L1, L2,
L3, and of L3 the node tier), for the capacity planner (``python -m vllm_hicache.planner``).

The format is ``planner/log_format.py``'s. What the scheduler half pays, per
request: a sampling decision, a tuple appended to a deque, no I/O, no
encoding. A daemon thread drains the deque every ``FLUSH_S``, encodes and
compresses the records and writes them. So that it can never slow the
scheduler or grow without bound:

- the deque holds at most ``MAX_QUEUED`` records; beyond, records are
  dropped and counted (``num_dropped``, and a DROPS record in the log);
- the file rotates into ``LOG.1`` (replacing the previous one) when it
  reaches half of ``hicache_access_log_max_mb``, so the two files together
  stay under it; a log found at start is rotated the same way;
- a write that fails (disk full), or any error while recording, turns the
  log off, with one warning: the log never fails a request;
- ``close`` (the connector's shutdown) writes what is queued, within
  ``CLOSE_TIMEOUT_S``;
- one writer per file: ``<log>.lock`` is held while writing, and a second
  process configured with the same path (the engines of a data-parallel
  server) writes ``<log>.<pid>`` instead.

Sampling (``hicache_access_log_sample`` r < 1) keeps a request when the hash
of its block 0 falls in the first r of the hash space: every request that
shares any block with another shares block 0 (chained hashes), so the sample
keeps whole families of requests that reuse each other, and the planner
replays them against capacities scaled by r. Requests shorter than a block
are sampled by request id. Files are created mode 0600: they hold no text,
but hashes of guessable prompts can be guessed.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from vllm_hicache import io_threads
from vllm_hicache.common.stats import overlap_blocks
from vllm_hicache.planner.log_format import (
    ADMIT,
    ARRIVE,
    FINISH,
    HASH_BYTES,
    MAGIC,
    LogHeader,
    encode_admit,
    encode_arrive,
    encode_drops,
    encode_finish,
    encode_header,
    frame,
    pack_chain,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_hicache.config import HiCacheConfig
    from vllm_hicache.connector.geometry import KVGeometry
    from vllm_hicache.l3.planner import L3Planner

logger = logging.getLogger(__name__)

# Records queued for the writer thread, at most; beyond, they are dropped.
MAX_QUEUED = 1 << 16
# The writer thread wakes this often.
FLUSH_S = 0.5
# One frame holds at most about this many bytes before compression.
FRAME_BYTES = 1 << 20
# Shutdown waits this long for the writer thread to write what is queued.
CLOSE_TIMEOUT_S = 5.0
# Requests admitted and not finished that the log remembers, at most.
MAX_LIVE = 1 << 20


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    """A bug in the log must never fail a request: it turns the log off."""

    @functools.wraps(method)
    def call(self: AccessLogWriter, *args: Any, **kwargs: Any) -> None:
        if self._broken:
            self.num_dropped += 1
            return
        try:
            method(self, *args, **kwargs)
        except Exception:
            self._broken = True
            logger.exception("HiCache access log: recording a request failed; the log is "
                             "off from now on")

    return call


class NullAccessLog:
    """No access log: every call does nothing."""

    num_dropped = 0

    def arrive(self, request: Request, step: int = 0) -> None:
        pass

    def admit(self, request: Request, l1_tokens: int, hit_tokens: int,
              l3: L3Planner | None = None, step: int = 0,
              l3_stages: dict[str, float] | None = None, direct_node_tokens: int = 0,
              declined_tokens: int = 0) -> None:
        pass

    def finish(self, request: Request, num_blocks_held: int, step: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


class AccessLogWriter(NullAccessLog):
    def __init__(self, path: str | Path, header: LogHeader, max_bytes: int,
                 max_queued: int = MAX_QUEUED, flush_s: float = FLUSH_S) -> None:
        assert max_bytes > 0, max_bytes
        self.path = Path(path)
        self.header = header
        self.max_file_bytes = max(len(MAGIC) + 4096, max_bytes // 2)
        self.sample = header.sample
        self._block_size = header.block_size
        self._max_queued = max_queued
        self._queue: collections.deque = collections.deque()
        self._seqs = itertools.count()
        # request id -> (seq, blocks in its chain when admitted)
        self._live: dict[str, tuple[int, int]] = {}
        self._t0 = time.monotonic()
        # Counted by the scheduler thread only; the writer reads it.
        self.num_dropped = 0
        self._num_reported = 0
        self.num_written = 0
        self._file: BinaryIO | None = None
        self._file_bytes = 0
        self._broken = False
        # The writer thread's drain and an explicit flush() never interleave.
        self._write_lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._claim()
        self._open(rotate_existing=True)
        self._stop = threading.Event()
        self._flush_s = flush_s
        self._thread = io_threads.named_thread(self._run, "hicache-log")
        self._thread.start()

    # --- scheduler thread: cheap, no I/O ------------------------------------

    @_never_raises
    def arrive(self, request: Request, step: int = 0) -> None:
        """A new request, before scheduler step ``step`` (on_new_request)."""
        seq = self._seq_of(request)
        if seq is not None:
            self._put((ARRIVE, self._now_ms(), seq, step))

    @_never_raises
    def admit(self, request: Request, l1_tokens: int, hit_tokens: int,
              l3: L3Planner | None = None, step: int = 0,
              l3_stages: dict[str, float] | None = None, direct_node_tokens: int = 0,
              declined_tokens: int = 0) -> None:
        """A request got its blocks in scheduler step ``step``: ``l1_tokens``
        from vLLM's cache, then ``hit_tokens`` from HiCache; ``l3`` (the
        L3Planner) says which of those its own prefetch brought in, and
        ``l3_stages`` where its wait for them went (seconds per stage,
        l3/hit_stages.py); ``direct_node_tokens`` of them are loaded from the
        node tier straight into L1 (scheduler/node_hits.py: no prefetch);
        ``declined_tokens`` after them HiCache held but the load gate chose
        to recompute (scheduler/load_gate.py)."""
        req_id = request.request_id
        hashes = request.block_hashes
        seq = self._seq_of(request)
        if seq is None:
            return
        self._live[req_id] = (seq, len(hashes))
        l3_tokens = node_tokens = 0
        fetched = l3.prefetched_range(req_id) if l3 is not None and hit_tokens else None
        if fetched is not None:
            assert l3 is not None
            start = l1_tokens // self._block_size
            end = start + hit_tokens // self._block_size
            l3_tokens = overlap_blocks(fetched, start, end) * self._block_size
            node_tokens = overlap_blocks(l3.node_range(req_id), start, end) * self._block_size
        l3_tokens += direct_node_tokens
        node_tokens += direct_node_tokens
        stages_us = ({stage: round(s * 1e6) for stage, s in l3_stages.items()}
                     if l3_stages and l3_tokens else None)
        self._put((ADMIT, self._now_ms(), seq, step, request.num_tokens, l1_tokens,
                   hit_tokens - l3_tokens, l3_tokens, request.priority, hashes, len(hashes),
                   stages_us, node_tokens, declined_tokens))

    @_never_raises
    def finish(self, request: Request, num_blocks_held: int, step: int = 0) -> None:
        """The request ended (or was aborted) before scheduler step ``step``,
        holding ``num_blocks_held`` L1 blocks."""
        live = self._live.pop(request.request_id, None)
        if live is None:
            return  # never admitted, or not sampled
        seq, lo = live
        hashes = request.block_hashes
        hi = min(len(hashes), request.num_computed_tokens // self._block_size)
        self._put((FINISH, self._now_ms(), seq, step, num_blocks_held, hashes, lo, max(lo, hi)))

    def _seq_of(self, request: Request) -> int | None:
        """The request's number, given at its first sight; None: not sampled."""
        req_id = request.request_id
        live = self._live.get(req_id)
        if live is not None:
            return live[0]  # arrived, or admitted again after a preemption
        if not self._sampled(req_id, request.block_hashes):
            return None
        seq = next(self._seqs)
        if len(self._live) >= MAX_LIVE:
            del self._live[next(iter(self._live))]
        self._live[req_id] = (seq, len(request.block_hashes))
        return seq

    def _sampled(self, req_id: str, hashes) -> bool:
        if self.sample >= 1.0:
            return True
        key = bytes(hashes[0][:HASH_BYTES]) if hashes else hashlib.blake2b(
            req_id.encode(), digest_size=HASH_BYTES).digest()
        return int.from_bytes(key, "little") < self.sample * 2.0**64

    def _now_ms(self) -> int:
        return int((time.monotonic() - self._t0) * 1000)

    def _put(self, item: tuple) -> None:
        if len(self._queue) >= self._max_queued or self._broken:
            self.num_dropped += 1
            return
        self._queue.append(item)

    # --- writer thread -------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            self.flush()

    def flush(self) -> None:
        """Write what is queued now (the writer thread does it every FLUSH_S)."""
        with self._write_lock:
            self._drain()

    def _drain(self) -> None:
        buf = bytearray()
        queue = self._queue
        while queue:
            buf += _encode(queue.popleft())
            if len(buf) >= FRAME_BYTES:
                self._write(bytes(buf))
                buf = bytearray()
        dropped = self.num_dropped - self._num_reported
        if dropped and not self._broken:
            self._num_reported += dropped
            buf += encode_drops(self._now_ms(), dropped)
        if buf:
            self._write(bytes(buf))

    def _write(self, payload: bytes) -> None:
        if self._broken:
            return
        data = frame(payload)
        try:
            if self._file_bytes + len(data) > self.max_file_bytes:
                self._open(rotate_existing=True)
            if self._file is None:
                raise RuntimeError(f"HiCache access log {self.path}: written after close()")
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            self._broken = True
            logger.warning("HiCache access log %s: writing failed (%s); the log is off "
                           "from now on", self.path, exc)
            return
        self._file_bytes += len(data)
        self.num_written += 1

    def _claim(self) -> int:
        """Hold ``<log>.lock`` while writing. Another live writer of the same
        path (engines of one data-parallel server share their options)
        makes this one write ``<log>.<pid>`` instead."""
        for path in (self.path, self.path.with_name(f"{self.path.name}.{os.getpid()}")):
            fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if path != self.path:
                logger.warning("HiCache access log %s is written by another process: "
                               "this one writes %s", self.path, path)
                self.path = path
            return fd
        raise OSError(f"{self.path}: locked by another writer")

    def _open(self, rotate_existing: bool) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if rotate_existing and self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        file = self._file = os.fdopen(fd, "wb")
        head = MAGIC + frame(encode_header(self.header))
        file.write(head)
        file.flush()
        self._file_bytes = len(head)

    def close(self) -> None:
        """Write what is queued (bounded by CLOSE_TIMEOUT_S) and close the file."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            with self._write_lock:
                self._drain()
                if self._file is not None:
                    self._file.close()
                    self._file = None
        os.close(self._lock_fd)  # releases the lock
        logger.info("HiCache access log %s closed (%d records dropped)",
                    self.path, self.num_dropped)


def _encode(item: tuple) -> bytes:
    if item[0] == ARRIVE:
        return encode_arrive(*item[1:])
    if item[0] == ADMIT:
        (_, t_ms, seq, step, tokens, l1, l2, l3, priority, hashes, n, stages_us, node,
         declined) = item
        return encode_admit(t_ms, seq, step, tokens, l1, l2, l3, priority,
                            pack_chain(hashes[:n]), stages_us, node, declined)
    _, t_ms, seq, step, held, hashes, lo, hi = item
    return encode_finish(t_ms, seq, step, held, pack_chain(hashes[lo:hi]))


def open_access_log(cfg: HiCacheConfig, geom: KVGeometry, num_pages: int,
                    local_ranks: int = 1) -> NullAccessLog:
    """The scheduler half's access log: a writer if ``hicache_access_log`` is set."""
    if not cfg.hicache_access_log:
        return NullAccessLog()
    from vllm_hicache.storage.format import HEADER_BYTES

    storage = cfg.storage
    capacity = storage.backend_options.get("max_bytes", 0) if storage is not None else 0
    l3_copies = 1 if geom.is_mla else local_ranks
    header = LogHeader(
        block_size=geom.block_size, page_bytes=geom.bytes_per_block, ranks=local_ranks,
        l1_blocks=geom.num_l1_blocks, l2_pages=num_pages,
        eviction_policy=cfg.radix_eviction_policy, write_policy=cfg.hicache_write_policy,
        l2_admission=str(cfg.l2_admission()), l3_admission=str(cfg.hicache_l3_admission),
        l3_mode=cfg.hicache_l3_mode.value,
        l3_backend=storage.backend if storage is not None else "",
        l3_prefetch_policy=storage.prefetch_policy if storage is not None else "",
        # 0 under "auto": the replay has no cost model and fetches any hit.
        l3_threshold_tokens=(storage.prefetch_threshold
                             if storage is not None and isinstance(storage.prefetch_threshold, int)
                             else 0),
        l3_capacity_bytes=capacity if isinstance(capacity, int) else 0,
        l3_block_bytes=(HEADER_BYTES + geom.bytes_per_block) * l3_copies,
        sample=cfg.hicache_access_log_sample, started=time.time(),
    )
    try:
        writer = AccessLogWriter(cfg.hicache_access_log, header,
                                 int(cfg.hicache_access_log_max_mb * 1e6))
    except OSError as exc:
        raise ValueError(f"hicache_access_log={cfg.hicache_access_log!r}: cannot create the "
                         f"log ({exc.strerror or exc})") from None
    logger.info("HiCache access log: %s (sample %g, at most %g MB on disk with %s.1)",
                writer.path, header.sample, cfg.hicache_access_log_max_mb, writer.path.name)
    return writer
