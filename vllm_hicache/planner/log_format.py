"""The access log's on-disk format, shared by the writer (scheduler/access_log.py)
and the planner. Pure module: stdlib and msgpack only.

A log file is a magic line followed by frames::

    b"HCACCESS1\\n"
    frame*   frame = u32 little-endian length N, then N bytes: zlib(msgpack objects)

Frames are compressed one by one, so a file cut short (a crash, a copy
taken while the server writes) loses at most its last frame. The first
object of the first frame is the header (a map, ``LogHeader``); then records,
msgpack arrays whose first item is their kind:

    [0, t_ms, seq, step, prompt_tokens, l1_tokens, l2_tokens, l3_tokens, priority, chain,
     l3_stages_us?, l3_node_tokens?, declined_tokens?]
        ADMIT: a request got its blocks in scheduler step ``step``; how many
        prompt tokens came from vLLM's own prefix cache (L1), from L2 and
        from L3 (its own prefetch). ``l3_stages_us``, written only with L3
        tokens (older writers never write it): where the request's wait
        for them went, a map of stage name (l3/hit_stages.py) to whole
        microseconds; its values sum to the wait from its L3 lookup to
        this record. ``l3_node_tokens``, written only when non-zero (then
        ``l3_stages_us`` is written too, nil when absent): of the L3 tokens,
        those the request's lookup found in the node tier (the machine's
        shared host memory) rather than the remote store behind it.
        ``declined_tokens``, written only when non-zero (the two fields before
        it then written too, nil / 0 when absent): tokens after the hit that
        L2 or the node tier held but the load gate (``hicache_load_decision``)
        chose to recompute, so a replay that counts them as hits is not
        wrong about the cache, only about the gate.
    [1, t_ms, seq, step, num_blocks_held, chain_ext]
        FINISH: the request ended before step ``step``, holding
        ``num_blocks_held`` L1 blocks; ``chain_ext`` are the blocks computed
        after its prompt (decode).
    [2, t_ms, num_dropped]
        DROPS: records the writer dropped since the last DROPS (it fell behind).
    [3, t_ms, seq, step]
        ARRIVE: the request reached the scheduler before step ``step`` (it is
        looked up in L3 then, against what L1 and L2 hold at that moment).

``t_ms`` is milliseconds since the header's ``started``; ``seq`` numbers the
requests of one server (never the request id). A chain is the concatenation
of the first ``hash_bytes`` (8) bytes of each of vLLM's block hashes, block 0
first. 8 bytes of a cryptographic hash collide with probability about
n^2 / 2^65 among n distinct blocks (1e-6 for 6 million blocks): negligible for
planning. No token ids or text are written; but a block hash of a guessable
prompt is still guessable (hash the guess, compare), so treat a log like the
prompts it was taken from.

A rotated log (``hicache_access_log_max_mb``) is two files, ``LOG.1`` (older)
and ``LOG``, each with its own header; read them in that order.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import msgpack

MAGIC = b"HCACCESS1\n"
FORMAT_VERSION = 1
HASH_BYTES = 8
_FRAME_LEN = struct.Struct("<I")
# A frame larger than this is corrupt, not a record batch.
MAX_FRAME_BYTES = 64 << 20

ADMIT, FINISH, DROPS, ARRIVE = 0, 1, 2, 3


@dataclass(frozen=True)
class LogHeader:
    """What the planner needs to know about the server that wrote the log."""

    # Tokens per block (= per L2 page).
    block_size: int
    # Bytes of one block's KV on one rank (one L2 page).
    page_bytes: int
    # Ranks that each hold a page of every block (TP ranks on this host).
    ranks: int
    # vLLM's KV cache, in blocks (one of them is vLLM's null block).
    l1_blocks: int
    # L2 pages per rank.
    l2_pages: int
    # radix_eviction_policy, hicache_write_policy.
    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    # The L1->L2 rule in force, hicache_l3_admission, hicache_l3_mode
    # (policy/admission.py); older logs: today's write-through.
    l2_admission: str = "always"
    l3_admission: str = "always"
    l3_mode: str = "inclusive"
    # The L3 backend's name, "" when the server ran without L3.
    l3_backend: str = ""
    l3_prefetch_policy: str = ""
    # prefetch_threshold, in tokens; 0 = "auto" (replayed as one block).
    l3_threshold_tokens: int = 0
    # The backend's capacity in bytes where configured (file max_bytes), 0 = unknown.
    l3_capacity_bytes: int = 0
    # Bytes of one block in L3, all ranks' objects together (header included).
    l3_block_bytes: int = 0
    # Fraction of requests logged (by their block 0, see scheduler/access_log.py).
    sample: float = 1.0
    # Unix time of t_ms = 0.
    started: float = 0.0
    hash_bytes: int = HASH_BYTES
    version: int = FORMAT_VERSION

    @property
    def block_bytes(self) -> int:
        """L2 bytes of one block, all ranks together."""
        return self.page_bytes * self.ranks

    def to_map(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_map(cls, values: dict[str, Any]) -> LogHeader:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


class Admit(NamedTuple):
    t_ms: int
    seq: int
    step: int
    prompt_tokens: int
    l1_tokens: int
    l2_tokens: int
    l3_tokens: int
    priority: int
    chain: tuple[bytes, ...]
    # Stage -> microseconds of the wait for the L3 part (None: none, or an older log).
    l3_stages_us: dict[str, int] | None = None
    # Of l3_tokens, those found in the node tier (0: none, or an older log).
    l3_node_tokens: int = 0
    # Held in L2 or the node tier, recomputed by the load gate's choice (0: none,
    # or an older log).
    declined_tokens: int = 0


class Finish(NamedTuple):
    t_ms: int
    seq: int
    step: int
    num_blocks_held: int
    chain_ext: tuple[bytes, ...]


class Drops(NamedTuple):
    t_ms: int
    num_dropped: int


class Arrive(NamedTuple):
    t_ms: int
    seq: int
    step: int


Record = Admit | Finish | Drops | Arrive


# --- writing ------------------------------------------------------------------


def pack_chain(hashes: Iterable[bytes]) -> bytes:
    """vLLM block hashes -> their 8-byte prefixes, concatenated."""
    return b"".join([bytes(h[:HASH_BYTES]) for h in hashes])


def _packb(obj: object) -> bytes:
    # msgpack ships no type information; packb returns bytes.
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def encode_header(header: LogHeader) -> bytes:
    return _packb(header.to_map())


def encode_admit(t_ms: int, seq: int, step: int, prompt_tokens: int, l1: int, l2: int,
                 l3: int, priority: int, chain: bytes,
                 l3_stages_us: dict[str, int] | None = None, l3_node_tokens: int = 0,
                 declined_tokens: int = 0) -> bytes:
    record = [ADMIT, t_ms, seq, step, prompt_tokens, l1, l2, l3, priority, chain]
    if l3_stages_us or l3_node_tokens or declined_tokens:
        record.append(l3_stages_us or None)
    if l3_node_tokens or declined_tokens:
        record.append(l3_node_tokens)
    if declined_tokens:
        record.append(declined_tokens)
    return _packb(record)


def encode_finish(t_ms: int, seq: int, step: int, num_blocks_held: int,
                  chain_ext: bytes) -> bytes:
    return _packb([FINISH, t_ms, seq, step, num_blocks_held, chain_ext])


def encode_drops(t_ms: int, num_dropped: int) -> bytes:
    return _packb([DROPS, t_ms, num_dropped])


def encode_arrive(t_ms: int, seq: int, step: int) -> bytes:
    return _packb([ARRIVE, t_ms, seq, step])


def frame(payload: bytes) -> bytes:
    """One frame of already packed objects."""
    body = zlib.compress(payload, 6)
    return _FRAME_LEN.pack(len(body)) + body


# --- reading ------------------------------------------------------------------


class LogReadError(ValueError):
    """Not an access log, or a version this planner does not read."""


def _split_chain(blob: bytes, hash_bytes: int) -> tuple[bytes, ...]:
    return tuple(blob[i : i + hash_bytes] for i in range(0, len(blob), hash_bytes))


def _frames(f: BinaryIO, name: str, cut: list[bool]) -> Iterator[bytes]:
    """The frames' payloads; ``cut[0]`` is set when the file ends inside a frame."""
    if f.read(len(MAGIC)) != MAGIC:
        raise LogReadError(f"{name} is not a HiCache access log (bad magic)")
    while True:
        head = f.read(_FRAME_LEN.size)
        if not head:
            return
        if len(head) < _FRAME_LEN.size:
            cut[0] = True
            return
        (size,) = _FRAME_LEN.unpack(head)
        body = f.read(size) if size <= MAX_FRAME_BYTES else b""
        if len(body) < size:
            cut[0] = True  # a crash, or a copy taken while the server wrote
            return
        try:
            yield zlib.decompress(body)
        except zlib.error:
            cut[0] = True
            return


@dataclass
class LogFile:
    header: LogHeader
    records: list[Record]
    # The file ended inside a frame: its last records are lost.
    truncated: bool = False


def read_log(path: str | Path) -> LogFile:
    """Read one log file: its header and every record, in write order."""
    path = Path(path)
    header: LogHeader | None = None
    records: list[Record] = []
    cut = [False]
    with path.open("rb") as f:
        for payload in _frames(f, str(path), cut):
            for obj in _unpack(payload):
                if header is None:
                    if not isinstance(obj, dict):
                        raise LogReadError(f"{path}: the first object is not a header")
                    header = LogHeader.from_map(obj)
                    if header.version != FORMAT_VERSION:
                        raise LogReadError(f"{path}: format version {header.version}, "
                                           f"this planner reads {FORMAT_VERSION}")
                    continue
                rec = _record(obj, header.hash_bytes)
                if rec is not None:
                    records.append(rec)
    if header is None:
        raise LogReadError(f"{path}: no header (an empty or cut-off log)")
    return LogFile(header, records, cut[0])


def _unpack(payload: bytes) -> Iterator[object]:
    unpacker = msgpack.Unpacker(raw=False, use_list=True)
    unpacker.feed(payload)
    yield from unpacker


def _record(obj: object, hash_bytes: int) -> Record | None:
    if not isinstance(obj, list) or not obj:
        return None
    kind = obj[0]
    if kind == ADMIT and len(obj) >= 10:
        stages = obj[10] if len(obj) > 10 and isinstance(obj[10], dict) else None
        node, declined = (obj[i] if len(obj) > i and isinstance(obj[i], int) else 0
                          for i in (11, 12))
        return Admit._make((*obj[1:9], _split_chain(obj[9], hash_bytes), stages, node,
                            declined))
    if kind == FINISH and len(obj) >= 6:
        return Finish._make((*obj[1:5], _split_chain(obj[5], hash_bytes)))
    if kind == DROPS and len(obj) >= 3:
        return Drops(obj[1], obj[2])
    if kind == ARRIVE and len(obj) >= 4:
        return Arrive(obj[1], obj[2], obj[3])
    return None  # a kind from a newer writer: skipped


@dataclass
class AccessLog:
    """One server's log, possibly rotated into several files."""

    header: LogHeader
    records: list[Record]
    # Files that ended inside a frame, and records the writer reported dropped.
    truncated_files: list[str]
    num_dropped: int
    # Distinct servers (writer starts) among the files; more than one is
    # replayed as one stream, in the order the files were given.
    num_writers: int = 1


def read_logs(paths: list[str | Path]) -> AccessLog:
    """Read the files of one log, oldest first (``LOG.1 LOG`` after a rotation).

    Every file must describe the same KV geometry. Sequence numbers of files
    from different writers are shifted apart, so their requests never mix.
    """
    if not paths:
        raise LogReadError("no access log given")
    first: LogHeader | None = None
    records: list[Record] = []
    truncated: list[str] = []
    started: list[float] = []
    seq_offset = seq_max = 0
    for path in paths:
        log = read_log(path)
        h = log.header
        if first is None:
            first = h
        elif (h.block_size, h.page_bytes, h.ranks, h.hash_bytes) != (
                first.block_size, first.page_bytes, first.ranks, first.hash_bytes):
            raise LogReadError(f"{path}: block size, page bytes or ranks differ from {paths[0]}")
        if log.truncated:
            truncated.append(str(path))
        if not started or h.started != started[-1]:
            if started:
                seq_offset = seq_max + 1
            started.append(h.started)
        shift_ms = round((h.started - first.started) * 1000)
        for rec in log.records:
            if isinstance(rec, Drops):
                records.append(rec._replace(t_ms=rec.t_ms + shift_ms))
                continue
            rec = rec._replace(t_ms=rec.t_ms + shift_ms, seq=rec.seq + seq_offset)
            seq_max = max(seq_max, rec.seq)
            records.append(rec)
    assert first is not None
    dropped = sum(r.num_dropped for r in records if isinstance(r, Drops))
    return AccessLog(first, records, truncated, dropped, len(started))
