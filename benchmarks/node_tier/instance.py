"""One instance of the node-tier benchmark: a vLLM offline engine (CPU, one
OpenMP thread, in this process) that takes commands on stdin and answers on
stdout, so that the benchmark drives several engines in several processes.

Protocol: one JSON object a line each way. vLLM logs to stdout too, so an
answer is a line starting with ``REPLY_PREFIX``. A command is
``{"op": ...}``: ``generate`` (``prompt``, ``max_tokens``) -> ``answer``,
``ttft_s``, ``cached``; ``reset_l1`` (vLLM's prefix cache only; L2 stays);
``settle`` (the engine's pending backups reach the node tier);
``stats`` -> ``hit_tokens`` per tier label, the storage backend's counters,
``direct_pages`` (pages loaded from the node tier straight into L1);
``quit``. A failed command answers ``{"error": ...}`` and the loop goes on.

    python benchmarks/node_tier/instance.py '<json: model, plan fields, extra>'
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

REPLY_PREFIX = "@@node-bench "
SETTLE_TIMEOUT_S = 120.0


def make_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = spec["extra"]
    ktc = None if extra is None else KVTransferConfig(
        kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
        kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    return LLM(model=spec["model"], dtype="float32", block_size=spec["block_tokens"],
               enable_prefix_caching=True, num_gpu_blocks_override=spec["l1_blocks"],
               kv_cache_memory_bytes=spec["l1_blocks"] * spec["page_bytes"] + (8 << 20),
               max_model_len=spec["max_model_len"], max_num_seqs=1,
               max_num_batched_tokens=spec["max_model_len"], enforce_eager=True, seed=0,
               distributed_executor_backend="uni", disable_log_stats=False,
               skip_tokenizer_init=True, kv_transfer_config=ktc)


class Engine:
    def __init__(self, spec: dict) -> None:
        self.connector = spec["extra"] is not None
        self.llm = make_llm(spec)

    def generate(self, prompt: list[int], max_tokens: int) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        m = out.metrics
        # queue: waiting in the engine (lookups, async loads); run: from the
        # step that admitted it to its first token (in-step loads, forward).
        return {"answer": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                "ttft_s": m.first_token_latency, "queue_s": m.scheduled_ts - m.queued_ts,
                "run_s": m.first_token_ts - m.scheduled_ts}

    def reset_l1(self) -> dict:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        return {}

    def settle(self) -> dict:
        """A request's last pages are handed to the worker by the next step:
        two small requests carry them, then the storage threads finish."""
        if not self.connector:
            return {}
        io = self._worker()._io
        for _ in range(2):
            self.generate([7, 8], 1)
            if io is not None and not io.wait_idle(SETTLE_TIMEOUT_S):
                raise RuntimeError(f"storage jobs still running after {SETTLE_TIMEOUT_S} s")
        return {}

    def stats(self) -> dict:
        if not self.connector:
            return {"hit_tokens": {}, "backend": {}}
        half = self.llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
        hits = {k.split(".", 1)[1]: v for k, v in half.stats.as_samples().items()
                if k.startswith("hit_tokens.")}
        worker = self._worker()
        io = worker._io
        backend = io.pages.backend.stats() if io is not None else {}
        queue = worker._node.queue
        direct = queue.loader.counts["pages"] if queue is not None and queue.loader else 0
        return {"hit_tokens": hits, "backend": backend,
                "load_error_blocks": half.stats.load_error_blocks,
                "direct_pages": direct}

    @staticmethod
    def _worker():
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().worker

    def close(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            ensure_kv_transfer_shutdown()


def reply(obj: dict) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(engine: Engine) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            return
        try:
            reply(getattr(engine, op)(**cmd) if op in ("generate", "reset_l1", "settle",
                                                       "stats") else
                  {"error": f"unknown op {op!r}"})
        except Exception:  # the driver reports it; the engine stays up
            reply({"error": traceback.format_exc(limit=4)})


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    spec = json.loads(sys.argv[1])
    started = time.monotonic()
    engine = Engine(spec)
    reply({"ready_s": time.monotonic() - started, "pid": os.getpid()})
    try:
        serve(engine)
    finally:
        engine.close()
    reply({"closed": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
