"""Helpers for tests that run a real in-process vLLM CPU engine."""

from __future__ import annotations

import gc
import os
import time

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK_SIZE = 32
# 32 blocks of 32 tokens: a small L1, so a few prompts evict each other.
KV_BYTES = 1 << 20


def make_llm(model_dir, extra: dict | None = None, *, connector: bool = True,
             kv_bytes: int = KV_BYTES, **kwargs):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if connector:
        ktc = KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
            kv_role="kv_both", kv_connector_extra_config=dict(extra or {}),
            kv_load_failure_policy="recompute",
        )
    params = dict(
        model=str(model_dir), dtype="float32", block_size=BLOCK_SIZE,
        enable_prefix_caching=True, max_model_len=512, max_num_seqs=4,
        max_num_batched_tokens=512, enforce_eager=True, seed=0,
        kv_cache_memory_bytes=kv_bytes, distributed_executor_backend="uni",
        skip_tokenizer_init=True, kv_transfer_config=ktc,
    )
    params.update(kwargs)
    try:
        return LLM(**params)
    except BaseException:
        # A start that failed after the worker connector was built would
        # leave it in vLLM's global and poison the next engine.
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        raise


def close(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ensure_kv_transfer_shutdown()
        del llm
        gc.collect()


def scheduler_half(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def worker_half():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def settle_backups(llm, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until every L3 backup of what ran so far is written
    and acknowledged to the scheduler half. A backup pins its pages, and
    ``reset_prefix_cache(reset_connector=True)`` keeps pinned pages in L2,
    so a test that then expects hits from L3 settles first: else the next
    pass hits L2 on a loaded machine. While the connector has pending push
    work, empty steps (as vLLM's own loop runs them) carry the
    acknowledgements back once the worker has written the objects; no
    request is added (the access log counts them). The writes run on
    background threads (io_threads.Background), which a loaded machine may
    keep from a core for a while."""
    core = llm.llm_engine.engine_core.engine_core
    io = worker_half()._io
    assert io is not None, "no L3 on this engine"
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_s = deadline - time.monotonic()
        assert remaining_s > 0, f"L3 backups not acknowledged after {timeout_s:g} s"
        assert io.wait_idle(remaining_s), f"L3 backups still in flight after {timeout_s:g} s"
        if not core.scheduler.has_requests():  # no request left, no work pending
            return
        core.step()


def generate(llm, prompts: list[list[int]], max_tokens: int = 12):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def prompts_with_shared_prefix() -> list[list[int]]:
    """Three prompts sharing a 70-token prefix; lengths not block-aligned."""
    shared = [3 + (i * 37) % 470 for i in range(70)]
    tails = [[5 + (i * k * 13) % 470 for i in range(n)] for k, n in ((1, 60), (2, 95), (3, 30))]
    return [shared + t for t in tails]


class ByteAudit:
    """Wraps the worker's transfer: snapshot L1 blocks as they are stored,
    and after every load compare the L1 block with the snapshot of its page.

    It only counts, never raises: a raise inside a load (on the loader
    thread, or in the worker's error handling) would become a load error and
    a silent recompute instead of a failed test. Tests assert the counts."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.kv = worker.transfer_tensors
        self.by_page: dict[int, list[torch.Tensor]] = {}
        self.checked_blocks = 0
        self.mismatches = 0
        # Loads of pages this audit never saw stored.
        self.unknown_pages = 0
        transfer = worker.transfer
        store, load_layer, load = transfer.store, transfer.load_layer, transfer.load

        def audited_store(block_ids, page_ids):
            store(block_ids, page_ids)
            for b, p in zip(block_ids, page_ids):
                self.by_page[p] = [t[b].clone() for t in self.kv]

        def audited_load_layer(layer, block_ids, page_ids):
            load_layer(layer, block_ids, page_ids)
            self._check(block_ids, page_ids, [layer])

        def audited_load(block_ids, page_ids):
            load(block_ids, page_ids)
            self._check(block_ids, page_ids, range(len(self.kv)))

        transfer.store = audited_store
        transfer.load_layer = audited_load_layer
        transfer.load = audited_load

    def _check(self, block_ids, page_ids, layers) -> None:
        for b, p in zip(block_ids, page_ids):
            snap = self.by_page.get(p)
            if snap is None:
                self.unknown_pages += 1
                continue
            for layer in layers:
                self.checked_blocks += 1
                if not torch.equal(self.kv[layer][b], snap[layer]):
                    self.mismatches += 1
