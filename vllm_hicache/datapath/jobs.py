"""The data path's own descriptors: which L1 blocks pair with which host
pages. The worker half translates the scheduler's wire types
(``connector/metadata.py``, which import vLLM) into these, so nothing here
needs vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Copy:
    """Pairs of (L1 block id, host page id), matched by position."""

    block_ids: tuple[int, ...] = ()
    page_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.page_ids), (
            len(self.block_ids), len(self.page_ids))

    def __len__(self) -> int:
        return len(self.block_ids)


# Nothing to copy (the default of the data path's copy arguments).
NO_COPY = Copy()


@dataclass(frozen=True)
class Load:
    """Host pages into one request's L1 blocks; a failure fails all of them."""

    req_id: str
    copy: Copy
