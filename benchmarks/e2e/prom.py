"""The server's ``/metrics`` counters a benchmark phase moved (after - before)."""

from __future__ import annotations

import re

from vllm_hicache.l3.hit_stages import STAGES

# name -> label that splits it (None: summed over all labels).
COUNTERS: dict[str, str | None] = {
    "vllm:prompt_tokens_total": None,
    "vllm:generation_tokens_total": None,
    "vllm:request_success_total": None,
    "vllm:num_preemptions_total": None,
    "vllm:prefix_cache_queries_total": None,
    "vllm:prefix_cache_hits_total": None,
    "vllm:external_prefix_cache_hits_total": None,
    "vllm:prompt_tokens_cached_by_source_total": "source",
    "vllm:hicache_hit_tokens_total": "tier",
    "vllm:hicache_transfer_bytes_total": "op",
    "vllm:hicache_transfer_seconds_total": "op",
    "vllm:hicache_prefetches_total": "event",
    "vllm:hicache_l3_errors_total": "kind",
    "vllm:hicache_load_failed_blocks_total": None,
    "vllm:hicache_l3_same_step_wait_seconds_total": None,
    "vllm:hicache_l2_evicted_pages_total": None,
    "vllm:hicache_load_decisions_total": "decision",
    # Server-side split of a request's time (histogram sums, seconds).
    "vllm:time_to_first_token_seconds_sum": None,
    "vllm:request_queue_time_seconds_sum": None,
    "vllm:request_prefill_time_seconds_sum": None,
    "vllm:request_queue_time_seconds_count": None,
    # Where the wait of each L3 hit went (the connector's histogram), per stage.
    "vllm:hicache_l3_hit_stage_seconds_sum": "stage",
    "vllm:hicache_l3_hit_stage_seconds_count": "stage",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, float]:
    """Flat ``name`` / ``name{label=value}`` sums of the counters above."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in COUNTERS:
            continue
        name, labels, value = match.groups()
        split = COUNTERS[name]
        key = name
        if split is not None:
            label = dict(_LABEL.findall(labels or "")).get(split, "")
            key = f"{name}{{{split}={label}}}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))
            if after.get(k, 0.0) != before.get(k, 0.0)}


def hit_tokens(moved: dict[str, float]) -> dict[str, float]:
    """Prompt tokens by where their KV came from: L1 (vLLM), L2, L3, computed."""
    src = "vllm:prompt_tokens_cached_by_source_total{source="
    l1 = moved.get(src + "device}", moved.get("vllm:prefix_cache_hits_total", 0.0))
    l2 = moved.get("vllm:hicache_hit_tokens_total{tier=L2}", 0.0)
    l3 = moved.get("vllm:hicache_hit_tokens_total{tier=L3}", 0.0)
    prompt = moved.get("vllm:prompt_tokens_total", 0.0)
    return {"prompt": prompt, "L1": l1, "L2": l2, "L3": l3,
            "host": moved.get(src + "host}", 0.0), "disk": moved.get(src + "disk}", 0.0),
            "computed": prompt - l1 - l2 - l3}


def time_split_ms(moved: dict[str, float]) -> dict[str, float]:
    """Per request, ms: the server's TTFT, time waiting in the queue (HiCache's
    L3 lookups and prefetches wait there) and prefill (loads included)."""
    n = moved.get("vllm:request_queue_time_seconds_count", 0.0)
    if not n:
        return {}
    return {k: 1000 * moved.get(f"vllm:{m}_seconds_sum", 0.0) / n
            for k, m in (("ttft", "time_to_first_token"), ("queue", "request_queue_time"),
                         ("prefill", "request_prefill_time"))}


def l3_stage_ms(moved: dict[str, float]) -> dict[str, float]:
    """Per L3 hit, ms: the mean of each stage of its wait (the order of
    ``vllm_hicache.l3.hit_stages.STAGES``), and ``hits``: how many;
    ``same_step``: of them, admitted in the step their read was sent;
    ``failed_blocks``: blocks whose load failed (same-step reads not done in
    time among them), recomputed; ``same_step_wait``: ms the forward waited
    for a same-step hit's read."""
    name = "vllm:hicache_l3_hit_stage_seconds"
    hits = moved.get(f"{name}_count{{stage=lookup}}", 0.0)
    if not hits:
        return {}
    out = {"hits": hits,
           "same_step": moved.get("vllm:hicache_prefetches_total{event=same_step}", 0.0),
           "failed_blocks": moved.get("vllm:hicache_load_failed_blocks_total", 0.0)}
    # The forward's wait for same-step reads, per same-step hit (ms).
    same_step = out["same_step"]
    out["same_step_wait"] = (1000 * moved.get("vllm:hicache_l3_same_step_wait_seconds_total", 0.0)
                             / same_step if same_step else 0.0)
    for stage in STAGES:
        count = moved.get(f"{name}_count{{stage={stage}}}", 0.0)
        out[stage] = 1000 * moved.get(f"{name}_sum{{stage={stage}}}", 0.0) / count if count else 0.0
    return out
