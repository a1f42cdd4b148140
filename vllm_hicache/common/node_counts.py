"""One instance's node tier page counts: exact, whatever vLLM does with the
reports that carry them.

Every process of an instance that writes to the node tier (each worker,
and the scheduler half's own member, which writes the L3 health check's
probes) counts what its stores did to the tier: pages it sealed (backups),
pages it read from the remote store and promoted, pages its reservations
evicted (storage/node_chain.py keeps them, cumulative per backend).

Invariants:
- ``NodeCountTally`` turns one process's backends' cumulative counts into
  totals since the process started: a backend replaced by an admin attach
  (a new object) starts from zero, so its counts add to the old ones. The
  same tally feeds the process's Prometheus counters (``take_gained``), so
  the counters and the totals are the same numbers, taken at other moments.
- Worker -> scheduler, the worker metadata carries each worker's running
  totals keyed by its worker id (``{worker id: NodeTierCounts}``), not
  increments, in every step's report once they are nonzero (one small
  record per worker). A worker's totals only grow, so two reports of one worker
  merge by the larger of each count (``latest``): a report merged twice, out
  of order, or lost and followed by a later one still leaves every worker
  at its latest totals. Increments summed in ``aggregate`` would count a
  duplicate twice and a loss never.
- The instance's counts (``InstanceNodeCounts.total``): the sum over
  workers of their latest totals, plus the scheduler half's own tally. Once
  the last report is in, they equal the instance's
  ``vllm:hicache_node_tier_*_pages_total`` counters.

Pure module: no torch, no vllm.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, fields

from vllm_hicache.common.stats import key

# NodeChainBackend.counts() name -> NodeTierCounts field -> Prometheus sample.
_FIELDS = (
    ("inserts", "stored_pages", key("node_tier_stored_pages")),
    ("promotions", "promoted_pages", key("node_tier_promoted_pages")),
    ("evictions", "evicted_pages", key("node_tier_evicted_pages")),
)


@dataclass(frozen=True)
class NodeTierCounts:
    """Pages one process (or an instance, summed) stored into, promoted into
    and evicted from the node tier."""

    stored_pages: int = 0
    promoted_pages: int = 0
    evicted_pages: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"NodeTierCounts.{f.name} must be a non-negative integer, "
                                 f"got {value!r}")

    def __add__(self, other: NodeTierCounts) -> NodeTierCounts:
        return NodeTierCounts(*(getattr(self, f.name) + getattr(other, f.name)
                                for f in fields(self)))

    def latest(self, other: NodeTierCounts) -> NodeTierCounts:
        """The later of two running totals of one process: the larger of
        each count (totals never go down)."""
        return NodeTierCounts(*(max(getattr(self, f.name), getattr(other, f.name))
                                for f in fields(self)))

    def gained_since(self, before: NodeTierCounts) -> NodeTierCounts:
        """What cumulative counts of one backend gained since ``before``."""
        return NodeTierCounts(*(max(0, getattr(self, f.name) - getattr(before, f.name))
                                for f in fields(self)))

    @classmethod
    def of_backend(cls, counts: Mapping[str, float]) -> NodeTierCounts:
        """From ``NodeChainBackend.counts()``."""
        return cls(**{name: int(counts.get(source, 0)) for source, name, _ in _FIELDS})

    def samples(self) -> dict[str, float]:
        """As Prometheus counter increments (stats.py keys); zeros left out."""
        return {sample: float(getattr(self, name)) for _, name, sample in _FIELDS
                if getattr(self, name)}

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


ZERO = NodeTierCounts()


class NodeCountTally:
    """One process's node tier counts since it started, over the backends it
    has had (module doc). Thread-safe: a worker's stats and its report are
    taken on vLLM's calls, the GET on the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backend: weakref.ref | None = None
        self._last = ZERO  # the observed backend's cumulative counts
        self._totals = ZERO
        self._gained = ZERO  # not yet taken for the Prometheus counters

    def observe(self, backend: object) -> None:
        """Add what ``backend``'s counts gained since it was last observed.
        A backend without node tier counts (no node tier) adds nothing."""
        counts = getattr(backend, "counts", None)
        if counts is None:
            return
        now = NodeTierCounts.of_backend(counts())
        with self._lock:
            if self._backend is None or self._backend() is not backend:
                self._backend, self._last = weakref.ref(backend), ZERO
            gained = now.gained_since(self._last)
            self._last = now
            self._totals += gained
            self._gained += gained

    @property
    def totals(self) -> NodeTierCounts:
        with self._lock:
            return self._totals

    def take_gained(self) -> NodeTierCounts:
        """What the totals gained since the last call (the Prometheus
        counters' increments)."""
        with self._lock:
            gained, self._gained = self._gained, ZERO
        return gained


class InstanceNodeCounts:
    """The scheduler half's view of its instance's counts (module doc)."""

    def __init__(self) -> None:
        self._workers: dict[int, NodeTierCounts] = {}
        self.own = NodeCountTally()

    def on_report(self, by_worker: Mapping[int, NodeTierCounts]) -> None:
        for worker, counts in by_worker.items():
            self._workers[worker] = self._workers.get(worker, ZERO).latest(counts)

    def own_samples(self, backend: object) -> dict[str, float]:
        """The scheduler half's own totals, ``backend`` (its L3 planner's,
        None: none attached) observed first, as cumulative samples for its
        metrics (stats.SchedulerReport turns them into increments)."""
        self.own.observe(backend)
        return self.own.totals.samples()

    def total(self, own_backend: object = None) -> NodeTierCounts:
        """The instance's counts; ``own_backend`` observed first."""
        self.own.observe(own_backend)
        return sum(self._workers.values(), self.own.totals)


def merge_reports(into: dict[int, NodeTierCounts],
                  other: Mapping[int, NodeTierCounts]) -> None:
    """Merge ``other``'s per-worker totals into ``into`` (worker metadata's
    ``aggregate``): per worker, the latest totals."""
    for worker, counts in other.items():
        have = into.get(worker)
        into[worker] = counts if have is None else have.latest(counts)
