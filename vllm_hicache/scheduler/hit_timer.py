"""The scheduler half's record of L3 hit stages (l3/hit_stages.py), for the
``l3_hit_stage_seconds`` histogram.

A request admitted with a hit its own prefetch brought in gives one
observation per wait stage at admission, and its ``load`` stage once the
scheduler sees the load end: a layerwise load when the output of the step it
was planned in comes back (vLLM returns one output per scheduled step, in
order, also with a batch queue, so the n-th ``update_connector_output`` is
step n's), an async one when its request is reported finished receiving.

Bounded: at most ``MAX_OBSERVATIONS`` values per stage wait between two
reports (beyond, new ones are dropped: the histogram is a sample), and at
most ``MAX_PENDING_LOADS`` loads are followed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from vllm_hicache.common.stats import key

MAX_OBSERVATIONS = 4096
MAX_PENDING_LOADS = 4096


class HitStageTimer:
    def __init__(self) -> None:
        # Sample key -> seconds observed since the last take.
        self._observed: dict[str, list[float]] = {}
        # Request -> (admitted at, step it was planned in, async load).
        self._loads: dict[str, tuple[float, int, bool]] = {}
        # Outputs of steps seen so far: the next one is step ``_steps_done``'s.
        self._steps_done = 0

    def admitted(self, req_id: str, stages: dict[str, float], step: int,
                 async_load: bool, now: float | None = None) -> None:
        """A request scheduled in ``step`` with a hit from its own prefetch;
        ``stages``: its wait, per stage (hit_stages.wait_stages)."""
        for stage, seconds in stages.items():
            self._observe(stage, seconds)
        if len(self._loads) < MAX_PENDING_LOADS:
            self._loads[req_id] = (time.monotonic() if now is None else now, step, async_load)

    def step_done(self, finished_recving: Iterable[str] = (),
                  now: float | None = None) -> None:
        """The output of the oldest step not yet seen came back, with the
        async loads it reports finished."""
        now = time.monotonic() if now is None else now
        step, self._steps_done = self._steps_done, self._steps_done + 1
        done = [r for r, (_, planned, is_async) in self._loads.items()
                if not is_async and planned <= step]
        done += [r for r in finished_recving if r in self._loads]
        for req_id in done:
            admitted, _, _ = self._loads.pop(req_id)
            self._observe("load", now - admitted)

    def forget(self, req_id: str) -> None:
        """The request finished (or was aborted): its load is not followed."""
        self._loads.pop(req_id, None)

    def _observe(self, stage: str, seconds: float) -> None:
        values = self._observed.setdefault(key("l3_hit_stage_seconds", stage), [])
        if len(values) < MAX_OBSERVATIONS:
            values.append(max(0.0, seconds))

    def take(self) -> dict[str, list[float]]:
        """Observations since the last take, by sample key."""
        observed, self._observed = self._observed, {}
        return observed
