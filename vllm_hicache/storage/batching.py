"""Cutting one call's batch of objects into pieces, in order.

- ``chunks``: consecutive index ranges bounded by a count and a byte budget,
  one backend round trip (or one staging buffer, or one scratch arena) each.
  An item larger than the budget comes alone, so every item is in exactly
  one range and the caller decides what an oversized one means.
- ``map_slices``: ``fn`` over the items on several threads, each thread one
  contiguous slice (the calling thread runs the first), results in order;
  all on the calling thread when it runs in the background (io_threads.py).
- ``batched``: fixed-size lists of an iterable (deletes in admin ``clear``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from itertools import islice
from typing import Any, Protocol, TypeVar

from vllm_hicache import io_threads

T = TypeVar("T")


class Submitter(Protocol):
    """What ``map_slices`` runs slices on: a ThreadPoolExecutor or a DaemonPool."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future: ...


def chunks(sizes: Sequence[int], *, max_items: int | None = None,
           max_bytes: int | None = None) -> Iterator[range]:
    """Ranges of ``sizes``' indices, each at most ``max_items`` long and
    ``max_bytes`` in total, except a lone item over ``max_bytes``."""
    start, used = 0, 0
    for i, nbytes in enumerate(sizes):
        full = (max_items is not None and i - start == max_items) or (
            max_bytes is not None and used + nbytes > max_bytes)
        if full and i > start:
            yield range(start, i)
            start, used = i, 0
        used += nbytes
    if start < len(sizes):
        yield range(start, len(sizes))


def map_slices(fn: Callable[[T], Any], items: Sequence[T], workers: int,
               executor: Callable[[], Submitter]) -> list[Any]:
    """``[fn(x) for x in items]``, split into ``workers`` contiguous slices run
    at once (``executor()`` is asked only when there are several). An
    exception of ``fn`` propagates; ``executor()`` may raise to refuse. A
    background thread (io_threads.py: a backup) runs every slice itself."""
    if io_threads.current_background() is not None:
        workers = 1
    workers = min(workers, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    bounds = [len(items) * w // workers for w in range(workers + 1)]

    def run(w: int) -> list[Any]:
        return [fn(x) for x in items[bounds[w]:bounds[w + 1]]]

    pool = executor()
    futures = [pool.submit(run, w) for w in range(1, workers)]
    first = run(0)
    return first + [r for f in futures for r in f.result()]


def batched(iterable: Iterable[T], n: int) -> Iterator[list[T]]:
    """Lists of ``n`` items (the last may be shorter); itertools.batched, 3.12."""
    it = iter(iterable)
    while batch := list(islice(it, n)):
        yield batch
