"""How a graceful stop spends vLLM's ``--shutdown-timeout``.

On SIGTERM/SIGINT, ``vllm serve`` lets EngineCore keep stepping for
``--shutdown-timeout`` seconds and then kills it (at once with vLLM's
default 0). Whatever HiCache still has to write to L3 must be out before
that kill, and the line counting what did not fit must be logged before it
too. So the budget is split in two, measured from the moment the scheduler
half sees the stop:

- ``flush_s``: the scheduler half keeps the engine stepping while queued
  backups (the in-flight ones and the deferred backlog, most valuable
  first) go out; at its end what is still deferred is dropped and counted;
- the rest, ``teardown_s``: vLLM's teardown, in which each worker's L3
  drain (``drain_s``, three quarters of it) finishes the writes still open,
  and the scheduler half logs its last line.

The teardown share is a third of the budget, at least 4 s and at most
10 s, never more than the budget itself. Why that much: on vLLM's CPU build
an idle engine's teardown alone (workers exiting, then EngineCore reaching
the connector's shutdown) took 3 to 4 s, and more on busy cores; a quarter
of a 20 s budget (5 s) left the last line racing vLLM's kill. With a budget
of 0 nothing is flushed (EngineCore dies with the signal) and the workers keep their
standing drain bound (``default_drain_s``) for the shutdowns that are not a
``vllm serve`` stop (``LLM`` closing, an in-process engine).

Pure module: no torch, no vllm.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TEARDOWN_S = 4.0
MAX_TEARDOWN_S = 10.0
TEARDOWN_SHARE = 1.0 / 3.0
DRAIN_SHARE_OF_TEARDOWN = 0.75


@dataclass(frozen=True)
class StopBudget:
    shutdown_timeout_s: float  # vLLM's --shutdown-timeout
    flush_s: float             # scheduler half: keep stepping to write backups
    drain_s: float             # each worker: finish the writes still open at teardown

    @property
    def graceful(self) -> bool:
        """Does a stop leave any time to write out what is queued?"""
        return self.flush_s > 0


def stop_budget(shutdown_timeout_s: float, default_drain_s: float) -> StopBudget:
    """The split of ``shutdown_timeout_s`` (see module doc)."""
    if shutdown_timeout_s < 0:
        raise ValueError(f"shutdown_timeout_s must be >= 0, got {shutdown_timeout_s}")
    if shutdown_timeout_s == 0:
        return StopBudget(0.0, 0.0, default_drain_s)
    teardown_s = min(shutdown_timeout_s,
                     max(MIN_TEARDOWN_S, min(MAX_TEARDOWN_S, TEARDOWN_SHARE * shutdown_timeout_s)))
    return StopBudget(float(shutdown_timeout_s), shutdown_timeout_s - teardown_s,
                      DRAIN_SHARE_OF_TEARDOWN * teardown_s)
