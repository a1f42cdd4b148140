"""Hand-made access logs for the planner's tests (no engine, no torch)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from vllm_hicache.planner.log_format import (
    MAGIC,
    AccessLog,
    Admit,
    Arrive,
    Finish,
    LogHeader,
    encode_admit,
    encode_arrive,
    encode_finish,
    encode_header,
    frame,
)

BS = 16


def blocks(*names: str) -> tuple[bytes, ...]:
    """A chain: block i's 8-byte hash covers names[0..i], as vLLM's do."""
    out, prev = [], b""
    for name in names:
        prev = hashlib.sha256(prev + name.encode()).digest()[:8]
        out.append(prev)
    return tuple(out)


def header(**kw) -> LogHeader:
    values = {"block_size": BS, "page_bytes": 1000, "ranks": 1, "l1_blocks": 5, "l2_pages": 16}
    values.update(kw)
    return LogHeader(**values)


class LogBuilder:
    """Records in the order a server would write them."""

    def __init__(self, **header_fields) -> None:
        self.header = header(**header_fields)
        self.records: list = []
        self.t_ms = 0
        self._seqs = 0

    def request(self, chain: tuple[bytes, ...], tokens: int | None = None, *, step: int = 0,
                arrive: bool = True, finish: bool = True, ext: tuple[bytes, ...] = (),
                hits: tuple[int, int, int] = (0, 0, 0), dt_ms: int = 10) -> int:
        """One request: ARRIVE and ADMIT at ``step``, then (``finish``) its FINISH."""
        seq = self._seqs
        self._seqs += 1
        tokens = len(chain) * BS + 1 if tokens is None else tokens
        if arrive:
            self.records.append(Arrive(self.t_ms, seq, step))
        self.records.append(Admit(self.t_ms, seq, step, tokens, *hits, 0, chain))
        if finish:
            self.finish(seq, tokens, step + 1, ext)
        self.t_ms += dt_ms
        return seq

    def arrive(self, step: int) -> int:
        """An ARRIVE alone (its ADMIT comes later, with ``admit``)."""
        seq = self._seqs
        self._seqs += 1
        self.records.append(Arrive(self.t_ms, seq, step))
        return seq

    def admit(self, seq: int, chain: tuple[bytes, ...], step: int) -> None:
        tokens = len(chain) * BS + 1
        self.records.append(Admit(self.t_ms, seq, step, tokens, 0, 0, 0, 0, chain))
        self.finish(seq, tokens, step + 1)

    def finish(self, seq: int, tokens: int, step: int, ext=()) -> None:
        """FINISH before ``step``, holding the blocks of the prompt and ``ext``."""
        held = -(-(tokens + len(ext) * BS) // BS)
        self.records.append(Finish(self.t_ms, seq, step, held, tuple(ext)))

    def log(self) -> AccessLog:
        return AccessLog(self.header, list(self.records), [], 0)

    def write(self, path: Path) -> Path:
        body = bytearray()
        for r in self.records:
            if isinstance(r, Arrive):
                body += encode_arrive(*r)
            elif isinstance(r, Admit):
                body += encode_admit(*r[:8], b"".join(r.chain))
            else:
                body += encode_finish(*r[:4], b"".join(r.chain_ext))
        path.write_bytes(MAGIC + frame(encode_header(self.header)) + frame(bytes(body)))
        return path
