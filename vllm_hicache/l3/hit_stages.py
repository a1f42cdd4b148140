"""Where the wait of an L3 hit goes: one request's time from its L3 lookup
to its hit being loaded into vLLM's KV cache, cut into stages.

The points, on the scheduler's monotonic clock (``time.monotonic``)::

    issued -> answered -> planned -> seen -> committed -> admitted -> loaded

and the stages between them:

==============  ==========================================================
``lookup``      issued -> answered: the store's ``exists`` calls (lookup thread)
``lookup_seen`` answered -> planned: the answer waiting for the scheduler's
                next ``build_connector_meta``, which plans the prefetch
``queue``       the prefetch waiting for an L3 thread on the worker (and for
                the copies issued before it)
``io``          the backend's reads and the copies into the host pool
``seal_check``  opening the sealed objects (checksum, MAC, decryption)
``step_wait``   the rest of planned -> seen: the job's trip to the workers in
                the step's metadata, and the finished read waiting for the
                step's worker report to come back
``l2_insert``   seen -> committed: the verified pages into the radix tree
``load_wait``   committed -> admitted: waiting for the scheduler to schedule
                the request with its hit
``load``        admitted -> loaded: the L2 -> L1 copy, as the scheduler sees
                it end (layerwise: the end of the step whose forward it
                overlaps; async: the request reported finished receiving)
==============  ==========================================================

``queue``, ``io`` and ``seal_check`` are the slowest rank's durations
(``PrefetchTiming``), measured on its own clock; only durations cross the
process boundary. They lie inside planned -> seen; if together they exceed
it (clock granularity), they are scaled down to fit.

Invariant: every stage is >= 0, and the stages before ``load`` sum exactly
to admitted - issued, the request's wait for its L3 hit. A point never
reached (a request admitted before its prefetch finished, a worker that
sent no timing) takes the next point's time: its stage is 0, and the time
goes to the next stage. Pure module: no torch, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hicache.common.jobs import PrefetchTiming

STAGES = ("lookup", "lookup_seen", "queue", "io", "seal_check", "step_wait", "l2_insert",
          "load_wait", "load")
# The stages that make up the wait before admission (all but ``load``).
WAIT_STAGES = STAGES[:-1]


@dataclass(slots=True)
class HitTimes:
    """The points one lookup and its prefetch op reached (None: not yet)."""

    issued: float
    answered: float | None = None
    planned: float | None = None
    seen: float | None = None
    committed: float | None = None
    # The slowest rank's durations (largest total), once any rank sent them.
    timing: PrefetchTiming | None = None

    def add_timing(self, timing: PrefetchTiming) -> None:
        """One rank's durations; the slowest rank's are kept."""
        if self.timing is None or sum(timing) > sum(self.timing):
            self.timing = timing


def wait_stages(times: HitTimes, admitted: float) -> dict[str, float]:
    """Seconds per stage (``WAIT_STAGES``) of a request admitted at ``admitted``."""
    reached = (times.issued, times.answered, times.planned, times.seen, times.committed)
    # A point not reached takes the next one's time; none is after admission.
    points = [admitted]
    for value in reversed(reached):
        points.append(points[-1] if value is None else min(value, points[-1]))
    issued, answered, planned, seen, committed, _ = reversed(points)
    span = seen - planned
    worker = times.timing if times.timing is not None else PrefetchTiming(0.0, 0.0, 0.0)
    worker_s = sum(max(0.0, s) for s in worker)
    scale = span / worker_s if worker_s > span else 1.0
    queue_s, io_s, check_s = (max(0.0, s) * scale for s in worker)
    return {
        "lookup": answered - issued,
        "lookup_seen": planned - answered,
        "queue": queue_s,
        "io": io_s,
        "seal_check": check_s,
        "step_wait": max(0.0, span - queue_s - io_s - check_s),
        "l2_insert": committed - seen,
        "load_wait": admitted - committed,
    }
