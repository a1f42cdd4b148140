"""Async loads the scheduler half has handed out and not yet seen complete.

Each holds its pinning operation (page_ops.py) until the workers report the request in
``finished_recving`` (even if the request was aborted meanwhile: vLLM then
keeps its blocks until the same report). The block hashes being loaded are
counted too: vLLM indexes an async-loaded block only when its load ends, so a
second request asking for the same blocks meanwhile would load the same
pages again; it is told to wait instead (``overlaps``).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hicache.common.page_ops import PageOp


class InflightLoads:
    def __init__(self) -> None:
        self._ops: dict[str, PageOp] = {}
        self._hashes_by_req: dict[str, list[bytes]] = {}
        self._hash_count: dict[bytes, int] = {}

    def start(self, req_id: str, op: PageOp, hashes: Sequence[bytes]) -> None:
        assert req_id not in self._ops, req_id
        self._ops[req_id] = op
        self._hashes_by_req[req_id] = list(hashes)
        for h in hashes:
            self._hash_count[h] = self._hash_count.get(h, 0) + 1

    def finish(self, req_id: str) -> PageOp | None:
        """The request's load completed: return its op to close."""
        for h in self._hashes_by_req.pop(req_id, ()):
            left = self._hash_count[h] - 1
            if left:
                self._hash_count[h] = left
            else:
                del self._hash_count[h]
        return self._ops.pop(req_id, None)

    def overlaps(self, hashes: Sequence[bytes]) -> bool:
        count = self._hash_count
        return bool(count) and any(h in count for h in hashes)

    def req_ids(self) -> set[str]:
        return set(self._ops)

    def __len__(self) -> int:
        return len(self._ops)
