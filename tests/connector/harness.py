"""Drive vLLM's real Scheduler plus our worker half in one process, no model.

The "forward" is fake but honest about bytes: for every token it computes,
it writes KV derived from every token up to it (as real KV is) into the
request's L1 block (CPU attention layout), so a load that puts the wrong
page into a block is caught by ``check_block``.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_hicache.connector import HiCacheConnector

BLOCK = 16
HEADS, HEAD_SIZE, LAYERS = 2, 32, 2


def _fake_backend():
    return SimpleNamespace(get_name=lambda: "CPU_ATTN")


@dataclass
class Harness:
    scheduler: Scheduler
    worker: HiCacheConnector
    kv: dict[str, torch.Tensor]
    hashes_of: dict[str, Request] = field(default_factory=dict)
    steps: int = 0
    # One entry per loaded block: did it hold exactly the KV computed for it?
    load_checks: list[bool] = field(default_factory=list)
    # Tokens a request had computed (local + L2 hit) when first scheduled.
    first_computed: dict[str, int] = field(default_factory=dict)
    # Async loads handed to the worker, checked when reported finished.
    pending_async: dict[str, object] = field(default_factory=dict)
    # Rewrites the workers' message before the scheduler sees it (to delay,
    # reorder or split acknowledgements); None passes it through.
    worker_meta_filter: object = None
    # What the engine core would send the front end (EngineCoreOutputs), latest steps.
    engine_outputs: deque = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def sched_half(self):
        return self.scheduler.connector.scheduler

    def close(self) -> None:
        """Shut both connector halves down in vLLM's teardown order (worker,
        then scheduler): their L3 threads, health checks and stores end with
        the test that made them. Idempotent, like the connector's shutdown."""
        self.worker.shutdown()
        self.scheduler.connector.shutdown()

    # --- requests --------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 3, priority: int = 0,
            kv_transfer_params: dict | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params}
                            if kv_transfer_params is not None else None)
        sp.update_from_generation_config({}, 2)
        req = Request(req_id, tokens, sp, None, priority=priority,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(req)
        self.hashes_of[req_id] = req
        return req

    # --- one step ------------------------------------------------------------

    def step(self, complete_async: bool = True):
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in self.kv:
            w.wait_for_layer_load(name)
        self._fake_forward(so)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        self.pending_async.update((job.req_id, job) for job in meta.async_loads)
        if complete_async and w.worker.data is not None:
            assert w.worker.data.wait_async_loads(10), "async loads did not finish in time"
        if complete_async and w.worker._io is not None:
            assert w.worker._io.wait_idle(10)
        sending, recving = w.get_finished(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        # A load must have put exactly the computed bytes in place, unless
        # the worker reported its blocks as failed (the forward never writes
        # loaded blocks: they count as computed).
        done = [self.pending_async.pop(r) for r in recving or () if r in self.pending_async]
        loads = [*meta.loads, *meta.same_step_loads, *done]  # same-step: l3/same_step.py
        self._verify_loads([j for j in loads if not set(j.copy.block_ids) & errors])
        worker_meta = w.build_connector_worker_meta()
        if self.worker_meta_filter is not None:
            worker_meta = self.worker_meta_filter(worker_meta)
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        kvo = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=errors, kv_connector_worker_meta=worker_meta,
                                kv_connector_stats=w.get_kv_connector_stats())
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] for _ in ids], kv_connector_output=kvo)
        for outputs in self.scheduler.update_from_output(so, out).values():
            self.engine_outputs.append(outputs)
        self.steps += 1
        return so

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            so = self.step()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.002)  # waiting on a background lookup or load
        raise AssertionError("requests did not finish within the step budget")

    def _verify_loads(self, jobs) -> None:
        for job in jobs:
            req = self.hashes_of[job.req_id]
            if job.req_id not in self.scheduler.requests:
                continue  # aborted meanwhile: its blocks may already be reused
            blocks = self.scheduler.kv_cache_manager.get_block_ids(job.req_id)[0]
            for block_id in job.copy.block_ids:
                self.load_checks.append(self.check_block(block_id, req, blocks.index(block_id)))

    def kv_zero(self) -> None:
        """Forget L1 bytes, so only a real load can bring them back."""
        for t in self.kv.values():
            t.zero_()

    # --- fake model ------------------------------------------------------------

    def _fake_forward(self, so) -> None:
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            start = starts[req_id]
            for pos in range(start, min(start + n, req.num_tokens)):
                # Every computed token, full block or not: a block completed
                # by a later step must already hold its earlier slots.
                self._write_slot(blocks[pos // BLOCK], req, pos)

    def _write_slot(self, block_id: int, req: Request, pos: int) -> None:
        for layer, t in enumerate(self.kv.values()):
            view = t.view(t.shape[0], HEADS, 2 * BLOCK, HEAD_SIZE)
            offset = pos % BLOCK
            view[block_id, :, offset] = expected_value(req, pos, layer, 0)
            view[block_id, :, BLOCK + offset] = expected_value(req, pos, layer, 1)

    def check_block(self, block_id: int, req: Request, index: int) -> bool:
        """Does L1 block ``block_id`` hold the KV of block ``index`` of ``req``?"""
        for layer, t in enumerate(self.kv.values()):
            view = t.view(t.shape[0], HEADS, 2 * BLOCK, HEAD_SIZE)
            for off in range(BLOCK):
                pos = index * BLOCK + off
                if not torch.all(view[block_id, :, off] == expected_value(req, pos, layer, 0)):
                    return False
                value = expected_value(req, pos, layer, 1)
                if not torch.all(view[block_id, :, BLOCK + off] == value):
                    return False
        return True


def expected_value(req: Request, pos: int, layer: int, plane: int) -> float:
    """The fake KV of token ``pos``: like real KV, a function of every token
    up to it (the previous block's chained hash, then this block's tokens)."""
    index = pos // BLOCK
    parent = req.block_hashes[index - 1] if index else b""
    tokens = req.all_token_ids[index * BLOCK : pos + 1]
    data = bytes(parent) + b"".join(int(x).to_bytes(4, "little") for x in tokens)
    digest = hashlib.blake2b(data + bytes([layer, plane]), digest_size=2).digest()
    return float(int.from_bytes(digest, "little") % 4093)


# Harnesses made and not yet closed: the root conftest closes them after each
# test (``close_open_harnesses``), so no test leaves threads behind that
# probe a store every second for the rest of the session.
_OPEN: list[Harness] = []


def close_open_harnesses() -> None:
    while _OPEN:
        _OPEN.pop().close()


def make_harness(model_dir, *, num_blocks: int = 64, max_num_seqs: int = 8,
                 max_batched: int = 256, load_failure_policy: str = "recompute",
                 kv_role: str = "kv_both", shutdown_timeout: int = 0,
                 **extra) -> Harness:
    init_none_hash(sha256)
    extra.setdefault("hicache_io_backend", "direct")
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_batched,
                                         max_model_len=512, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
            kv_role=kv_role, kv_connector_extra_config=extra,
            kv_load_failure_policy=load_failure_policy),
        shutdown_timeout=shutdown_timeout,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    for name in names:
        vllm_config.compilation_config.static_forward_context[name] = SimpleNamespace(
            attn_backend=_fake_backend())
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=BLOCK, log_stats=True)
    worker = HiCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv = {n: torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE) for n in names}
    worker.register_kv_caches(kv)
    harness = Harness(scheduler, worker, kv)
    _OPEN.append(harness)
    return harness
