"""The scheduler half's side of load decisions (policy/load.py).

``LoadGate`` feeds the estimators from what reaches the scheduler process
and counts the decisions:

- **Step times.** ``step_planned`` (end of ``build_connector_meta``) records
  when step N was handed to the executor, with its scheduled tokens and
  attention pairs; ``step_done`` (``update_connector_output``) takes its
  result. vLLM calls ``update_connector_output`` for every step that ran a
  forward, in scheduling order, but for a step that scheduled nothing (a
  request waiting for L3, say) only if a worker had something to report.
  With synchronous scheduling a result always belongs to the latest step
  planned. With a batch queue (async scheduling, pipeline parallelism:
  detected when a step with tokens is planned before the previous one's
  result came back) the result belongs to the oldest step outstanding, and
  a step's time is taken only where that pairing is certain: no step
  without tokens outstanding. A step's time runs from when it could start
  (planned, and the previous result was in) to its result. Steps that
  loaded layer by layer or wrote back before the forward are left out:
  their copies would count as compute.
- **Transfers.** The workers' ``HiCacheKVConnectorStats`` of the step
  (``KVConnectorOutput.kv_connector_stats``: vLLM sums the ranks' reports
  and hands them to the scheduler's ``update_from_output``, which calls
  ``update_connector_output`` before adding the scheduler's own): bytes and
  seconds of ``load`` and ``prefetch``.
- **Decisions** (``load_decisions`` series: tokens by tier and decision):
  ``L2`` when a request is admitted with an L2 hit (``loaded`` or
  ``declined``); ``node`` likewise for a node-tier hit loaded into L1
  directly (scheduler/node_hits.py); ``L3`` when a finished lookup under a waiting prefetch
  policy is judged (``loaded``: the request waits for the prefetch;
  ``declined``: it does not, and computes; the prefetch still runs for later
  requests, and keeps the L3 estimate fresh).

Pure module at run time: no torch, no vllm (the vLLM objects are read by
attribute; their types are imported for the type checker only).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_hicache.common.stats import key
from vllm_hicache.policy.load import MIN_PREFILL_TOKENS, LoadDecider, attention_pairs

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.sched.output import SchedulerOutput

# The decisions' tier name of node-tier hits loaded into L1 directly.
TIER_NODE = "node"
# Steps outstanding beyond this: the pairing is lost; start over.
_MAX_OUTSTANDING = 8


@dataclass(slots=True)
class _Planned:
    built_at: float
    num_tokens: int
    attn_pairs: float
    sample: bool        # a prefill step without copies inside the forward


class LoadGate:
    def __init__(self, mode: str, page_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.decider = LoadDecider(mode, page_bytes, clock=clock)
        self.clock = clock
        self._outstanding: deque[_Planned] = deque()
        self._last_done: float | None = None
        # A batch queue plans step N+1 before N's result (see module doc).
        self.pipelined = False
        self._awaiting_result = False   # a step with tokens planned, no result since
        # (tier, decision) -> tokens, since engine start.
        self.decisions: dict[tuple[str, str], int] = {}

    @property
    def auto(self) -> bool:
        return self.decider.auto

    # --- decisions ---------------------------------------------------------

    def load_l2(self, start: int, num_tokens: int, num_pages: int) -> bool:
        return self.decider.load_l2(start, num_tokens, num_pages)

    def load_node(self, start: int, num_tokens: int, num_pages: int) -> bool:
        """A node-tier hit loaded into L1 directly: a copy from host memory
        by the same copy engines as an L2 hit's, so the L2 estimate judges it."""
        return self.decider.load_l2(start, num_tokens, num_pages)

    def prefetch_l3(self, start: int, num_tokens: int, num_pages: int) -> bool:
        return self.decider.prefetch_l3(start, num_tokens, num_pages)

    def wants_l3_sample(self) -> bool:
        return self.decider.wants_l3_sample()

    def observe_l3_latency(self, seconds: float) -> None:
        self.decider.observe_l3_latency(seconds)

    def record(self, tier: str, loaded: bool, num_tokens: int) -> None:
        if num_tokens > 0:
            k = (tier, "loaded" if loaded else "declined")
            self.decisions[k] = self.decisions.get(k, 0) + num_tokens

    # --- measurements --------------------------------------------------------

    def step_planned(self, scheduler_output: SchedulerOutput, copies_in_forward: bool) -> None:
        """End of build_connector_meta: step N goes to the executor now."""
        total = scheduler_output.total_num_scheduled_tokens
        sample = False
        attn = 0.0
        if total > 0 and not copies_in_forward and self.decider.auto:
            num_reqs = len(scheduler_output.num_scheduled_tokens)
            # Cheap test first: a decode-only step needs no walk.
            if total - num_reqs >= MIN_PREFILL_TOKENS:
                attn, prefill = _attention(scheduler_output)
                sample = prefill >= MIN_PREFILL_TOKENS and 2 * prefill >= total
        if total > 0:
            if self._awaiting_result:
                self.pipelined = True
            self._awaiting_result = True
        self._outstanding.append(_Planned(self.clock(), total, attn, sample))
        if len(self._outstanding) > _MAX_OUTSTANDING:
            self._outstanding.clear()

    def step_done(self, connector_stats: KVConnectorStats | None) -> None:
        """update_connector_output: the result of a step (see module doc)."""
        now = self.clock()
        self._awaiting_result = False
        self._observe_transfers(connector_stats)
        outstanding = self._outstanding
        planned = None
        if not self.pipelined:
            if outstanding:
                planned = outstanding.pop()  # the latest: earlier ones had their chance
                outstanding.clear()
        elif len(outstanding) > 1 and any(p.num_tokens == 0 for p in outstanding):
            # A step without a forward may or may not have reported: the
            # result cannot be paired. Start over.
            outstanding.clear()
        elif outstanding:
            planned = outstanding.popleft()
        if planned is not None:
            started = planned.built_at
            if self._last_done is not None and self._last_done > started:
                started = self._last_done  # it waited for the previous step
            if planned.sample:
                self.decider.observe_step(planned.num_tokens, planned.attn_pairs, now - started)
        self._last_done = now

    def _observe_transfers(self, connector_stats: KVConnectorStats | None) -> None:
        if not self.decider.auto:
            return
        data = getattr(connector_stats, "data", None)
        counters = data.get("counters") if isinstance(data, dict) else None
        if not counters:
            return
        self.decider.observe_transfers(
            load=(counters.get(key("transfer_bytes", "load"), 0.0),
                  counters.get(key("transfer_seconds", "load"), 0.0)),
            prefetch=(counters.get(key("transfer_bytes", "prefetch"), 0.0),
                      counters.get(key("transfer_seconds", "prefetch"), 0.0)),
        )

    # --- metrics -------------------------------------------------------------

    def counter_samples(self) -> dict[str, float]:
        return {key("load_decisions", tier, decision): tokens
                for (tier, decision), tokens in self.decisions.items()}

    def gauge_samples(self) -> dict[str, float]:
        """Estimates in use, rounded to 3 significant digits (a gauge is
        reported when it changes)."""
        est = self.decider.estimates()
        out = {key("estimated_bandwidth_bytes_per_second", tier): _round3(est[tier])
               for tier in ("L2", "L3") if tier in est}
        if "prefill" in est:
            out[key("estimated_prefill_tokens_per_second")] = _round3(est["prefill"])
        return out


def _attention(scheduler_output: SchedulerOutput) -> tuple[float, int]:
    """Attention pairs of the step, and its tokens of requests scheduled for
    more than one token (prefills)."""
    scheduled = scheduler_output.num_scheduled_tokens
    attn, prefill = 0.0, 0
    for new in scheduler_output.scheduled_new_reqs:
        n = scheduled.get(new.req_id, 0)
        attn += attention_pairs(n, new.num_computed_tokens)
        if n > 1:
            prefill += n
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, context in zip(cached.req_ids, cached.num_computed_tokens):
        n = scheduled.get(req_id, 0)
        attn += attention_pairs(n, context)
        if n > 1:
            prefill += n
    return attn, prefill


def _round3(value: float) -> float:
    return float(f"{value:.3g}")
