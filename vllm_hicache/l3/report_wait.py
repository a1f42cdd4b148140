"""The prefetch report wait: a step whose output a request waits on for its
L3 hit lets the workers give their in-flight prefetches a moment to finish
before the step reports.

Why: a prefetch leaves with step N's metadata and is read on an L3 thread
while step N runs. Its completion reaches the scheduler only with a step's
output; a read that ends just after step N's report was taken (an empty
step takes under a millisecond, a read of a few pages a millisecond or two)
is seen with step N+1's output, and its request is admitted at N+2 instead
of N+1: a whole step later, which under load is a whole forward.

The rule: the scheduler half puts a budget into a step's metadata
(``HiCacheMetadata.prefetch_wait_s``) when a request waits for a prefetch
still open (``wants_wait``); each worker then blocks, just before it builds
its report, until its open prefetches finish or the budget is spent,
whichever is first. The budget is per step and per worker (ranks wait side
by side), and 0 otherwise, so a step with nobody waiting for a prefetch
(best_effort, a declined hit, no prefetch at all) never waits. The cost is
the lookup wait's (l3/planner.py ``LOOKUP_WAIT_PER_STEP_S``): at most
``PREFETCH_REPORT_WAIT_S`` of each such step, for every request in it; the
gain, a step, when the read ends within it. Pure module: no torch, no vLLM.
"""

from __future__ import annotations

# Seconds a worker may block per step, before its report, for open prefetches.
PREFETCH_REPORT_WAIT_S = 0.002


def step_budget_s(prefetch_waited_on: bool) -> float:
    """The step's budget: ``PREFETCH_REPORT_WAIT_S`` if a request waits for
    an open prefetch, else 0 (read at call time, so a test may raise it)."""
    return PREFETCH_REPORT_WAIT_S if prefetch_waited_on else 0.0
