"""Replay an access log's steps (l1.py's ``l1_pass``) through L2 (the
HiRadixTree with the configured policies) and L3 (an LRU of objects).

It mirrors the scheduler half (scheduler/scheduler.py, l3/planner.py)
scheduler step by scheduler step (the log says which step admitted each
request, and before which step it arrived):

    ARRIVE  on_new_request: the loadable blocks past the first one that
            neither L1 nor L2 holds on arrival are looked up in L3.
    ADMIT   the admissions of one step: each lookup (the run of L2 pages
            after the L1 hit; the part its own prefetch brought is its L3
            hit), its hit touched and pinned by its load; then the step's
            stores (the write policy: under write-through every computed
            block L2 lacks): first the blocks the running requests completed
            (one token a step after their prefill), then the new requests'
            prompts, pinned until the step ends and backed up to L3 unless
            L3 has them; then build_connector_meta starts the prefetches of
            the lookups that hit at least threshold blocks: pages allocated
            protecting the chain, within SGLang's in-flight cap.
    land    a prefetch started at step s is read during s + 1 and committed
            into L2 as its output comes back: usable from step s + 2, or as
            soon as its request is admitted if it waits for it
            (wait_complete, timeout: ``prefetch_waits``).
    FINISH  whatever it decoded and was not stored yet is.

Which stored blocks reach L3, and when (hicache_l3_admission,
hicache_l3_mode), is l3_boundary.py's; the L1 -> L2 admission rule is the
write policy's (policy/write.py), as in the engine.

Write-back stores a block when L1 evicts it, after the step that evicted it,
if the watcher still tracks it (l1.py's ``_Tracked``). Approximated: the
write-back watcher's and the selective write policy's bounded tables, a
long prompt's chunked prefill (all of it at its admission step), a
preemption (its blocks are freed when the request is admitted again).
Not modelled: backups still in flight (an object is in L3 as soon as its
page is stored), failures, timeouts. Pure module.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from vllm_hicache.index import HiRadixTree
from vllm_hicache.index.node import LockHandle
from vllm_hicache.planner.l1 import AdmitStep, ArriveStep, Chain, FinishStep, Step, loadable_blocks
from vllm_hicache.planner.l3_boundary import L3Boundary
from vllm_hicache.planner.log_format import Admit
from vllm_hicache.planner.model import L3Store, ReplayConfig, ReplayResult
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.policy.admission import ALWAYS
from vllm_hicache.policy.prefetch import prefetch_inflight_cap
from vllm_hicache.policy.write import WritePolicy, WritePolicyName, hit_counter_slots

# A prefetch planned at step s is read during s + 1 and committed as its
# output comes back: first usable by a request admitted at s + LAND_STEPS.
LAND_STEPS = 2


class _Lookup(NamedTuple):
    """A finished L3 lookup, waiting for build_connector_meta to start it."""

    seq: int
    step: int  # the step whose build_connector_meta starts it
    chain: Chain
    resident: int
    end: int  # the L3 hit is blocks [resident, end)


class _Prefetch(NamedTuple):
    seq: int
    land_step: int
    chain: Chain  # blocks 0 .. start + len(pages)
    start: int
    pages: list[int]


class Hierarchy:
    """L2 and L3, driven the way the scheduler half drives them."""

    def __init__(self, cfg: ReplayConfig) -> None:
        self.cfg = cfg
        self.tree = HiRadixTree(cfg.l2_pages, make_eviction_policy(cfg.eviction_policy),
                                clock=itertools.count().__next__, on_evict=self._evicted)
        l2_rule = None if cfg.l2_admission == ALWAYS else cfg.l2_admission
        self.write = WritePolicy(cfg.write_policy, hit_counter_slots(cfg.l2_pages), l2_rule,
                                 cfg.block_size)
        self.l3 = L3Store(cfg.l3_objects) if cfg.l3_objects != 0 else None
        self.result = ReplayResult()
        self.boundary = (L3Boundary(cfg, self.l3, self.result,
                                    lambda chain: self.tree.match(chain).pages)
                         if self.l3 is not None else None)
        self.max_prefetch_pages = prefetch_inflight_cap(cfg.l2_pages, cfg.l1_blocks)
        self._inflight_pages = 0
        self._lookups: list[_Lookup] = []
        self._prefetches: list[_Prefetch] = []
        # seq -> blocks [lo, hi) its own prefetch put into L2 (prefetched_range).
        self._fetched: dict[int, tuple[int, int]] = {}
        self._arrived: set[int] = set()
        # Requests decoding: seq -> (admission step, prompt tokens, final
        # chain, generation); each block is stored at the step that completes
        # it (due step, generation, seq, block), as L2StorePlanner.advance does.
        self._decoding: dict[int, tuple[int, int, Chain, int]] = {}
        self._decode_due: list[tuple[int, int, int, int]] = []
        # seq -> blocks [0, n) considered for a store (ReqState.num_planned).
        self._planned: dict[int, int] = {}
        self._gens = itertools.count()

    def _evicted(self, hashes: list[bytes]) -> None:
        if self.boundary is not None:
            self.boundary.evicted(hashes)

    # --- ARRIVE: L3 lookups and prefetches -----------------------------------------

    def arrive_step(self, batch: list[ArriveStep]) -> None:
        """Requests that arrived before one step, each looked up in L3 past
        what L1 and L2 hold on arrival (on_new_request)."""
        self._advance(batch[0].step)
        self._store_decoded(batch[0].step - 1)
        self._arrived.update(a.seq for a in batch)
        if self.l3 is None:
            return
        for a in batch:
            pages = self.tree.match(a.chain).pages
            resident = 0
            while resident < len(a.chain) and (
                    a.in_l1[resident] or (resident < len(pages) and pages[resident] is not None)):
                resident += 1
            end = self._l3_hit(self.l3, a.chain, resident)
            if end - resident >= self.cfg.l3_threshold_blocks:
                self._lookups.append(_Lookup(a.seq, a.step, a.chain, resident, end))

    def _l3_hit(self, l3: L3Store, chain: Chain, resident: int) -> int:
        """start_lookup: where the L3 hit past ``resident`` ends (``resident``: none)."""
        if len(chain) - resident < self.cfg.l3_threshold_blocks:
            return resident
        return resident + l3.prefix_len(chain[resident:])

    def _advance(self, step: int, *, step_done: bool = False, seq: int | None = None) -> None:
        """Start the lookups whose build_connector_meta has come (that of
        ``step`` itself once ``step_done``), land the prefetches due by
        ``step``; ``seq``'s own (a request that waits for it) at once."""
        def due(item: _Lookup) -> bool:
            return item.step < step or (step_done and item.step == step) or item.seq == seq

        if self._lookups:
            started = [lk for lk in self._lookups if due(lk)]
            self._lookups = [lk for lk in self._lookups if not due(lk)]
            for lk in started:
                self._start_prefetch(lk)
        if self._prefetches:
            landed = [p for p in self._prefetches if p.land_step <= step or p.seq == seq]
            self._prefetches = [p for p in self._prefetches
                                if not (p.land_step <= step or p.seq == seq)]
            for p in landed:
                self._land(p)

    def _start_prefetch(self, lk: _Lookup) -> None:
        """_start_op: pages now, in the tree when it lands."""
        threshold = self.cfg.l3_threshold_blocks
        matched = self.tree.match(lk.chain[: lk.end]).pages
        start = lk.resident
        while start < len(matched) and matched[start] is not None:
            start += 1  # arrived in L2 meanwhile
        num = min(lk.end - start, self.max_prefetch_pages - self._inflight_pages)
        if num < threshold:
            return
        with self._pinned(lk.chain, len(matched)):
            pages = self.tree.alloc(num)
        if pages is None:
            return
        self._inflight_pages += num
        self._prefetches.append(
            _Prefetch(lk.seq, lk.step + LAND_STEPS, lk.chain[: start + num], start, pages))

    def _land(self, p: _Prefetch) -> None:
        pages: list[int | None] = [None] * p.start
        pages += p.pages
        unused = self.tree.insert(p.chain, pages)
        if unused:
            self.tree.free(unused)
        assert self.l3 is not None, "a prefetch reads from L3"
        self.l3.read(p.chain[p.start:])
        self._inflight_pages -= len(p.pages)
        self._fetched[p.seq] = (p.start, len(p.chain))

    # --- ADMIT: lookups, then stores --------------------------------------------

    def admit_step(self, batch: list[AdmitStep]) -> None:
        """The admissions of one scheduler step: every lookup first, its hit
        pinned by its load; then build_connector_meta: the stores of the
        running requests' decoded blocks and of the new requests' prompts,
        pinned until the step ends, then the prefetches of the lookups that
        finished meanwhile."""
        step = batch[0].record.step
        self._advance(step)
        self._store_decoded(step - 1)
        locks, hit_ends = [], []
        for adm in batch:
            hit_end = self._lookup(adm.record, adm.l1_blocks)
            hit_ends.append(hit_end)
            if hit_end > adm.l1_blocks:
                locks.append(self.tree.lock(adm.record.chain, hit_end))
        self._store_decoded(step, locks)
        for adm, hit_end in zip(batch, hit_ends):
            rec = adm.record
            # A request admitted again (after a preemption) considers only
            # what it recomputes (L2StorePlanner.advance's lo).
            lo = min(self._planned[rec.seq], hit_end) if rec.seq in self._planned else 0
            locks += self.store(rec.chain, lo, -rec.priority)
            self._start_decode(rec, adm.final_chain)
        for lock in locks:
            self.tree.unlock(lock)
        if self.boundary is not None:
            self.boundary.step_done()
        self._advance(step, step_done=True)

    def _lookup(self, rec: Admit, l1_hit: int) -> int:
        """get_num_new_matched_tokens + update_state_after_alloc; returns
        where the request's hit ends, in blocks."""
        bs = self.cfg.block_size
        loadable = rec.chain[: loadable_blocks(rec.prompt_tokens, bs)]
        if self.l3 is not None and rec.seq not in self._arrived:
            # A log without ARRIVE records: look up L3 at admission.
            resident = l1_hit + len(self.tree.match(loadable).host_run(l1_hit))
            end = self._l3_hit(self.l3, loadable, resident)
            if end - resident >= self.cfg.l3_threshold_blocks:
                self._lookups.append(_Lookup(rec.seq, rec.step, loadable, resident, end))
        if self.cfg.prefetch_waits:
            self._advance(rec.step, seq=rec.seq)
        run = len(self.tree.match(loadable).host_run(l1_hit))
        l3_hit = 0
        fetched = self._fetched.get(rec.seq)
        if fetched is not None:
            l3_hit = max(0, min(l1_hit + run, fetched[1]) - max(l1_hit, fetched[0]))
        self.tree.touch(rec.chain, l1_hit + run, priority=-rec.priority)
        if self.boundary is not None:
            self.boundary.used(rec.chain[: l1_hit + run])
        res = self.result
        res.requests += 1
        res.prompt_tokens += rec.prompt_tokens
        res.l1_tokens += l1_hit * bs
        res.l2_tokens += (run - l3_hit) * bs
        res.l3_tokens += l3_hit * bs
        res.per_request.append((l1_hit * bs, (run - l3_hit) * bs, l3_hit * bs))
        return l1_hit + run

    # --- stores --------------------------------------------------------------------

    def _start_decode(self, rec: Admit, final_chain: Chain) -> None:
        gen = next(self._gens)
        self._planned[rec.seq] = len(rec.chain)
        self._decoding[rec.seq] = (rec.step, rec.prompt_tokens, final_chain, gen)
        self._schedule_decode(rec.seq, len(rec.chain))

    def _schedule_decode(self, seq: int, block: int) -> None:
        """Block ``block`` is complete once the request computed
        (block + 1) x block_size tokens: its prefill at its admission step,
        then a token a step."""
        step, num_tokens, final_chain, gen = self._decoding[seq]
        if block < len(final_chain):
            due = step + (block + 1) * self.cfg.block_size - num_tokens
            heapq.heappush(self._decode_due, (due, gen, seq, block))

    def _store_decoded(self, step: int, locks: list[LockHandle] | None = None) -> None:
        """Store the decoded blocks complete by ``step``; their pins go to
        ``locks`` (None: their step is over, unpinned at once)."""
        due = self._decode_due
        while due and due[0][0] <= step:
            _, gen, seq, block = heapq.heappop(due)
            run = self._decoding.get(seq)
            if run is None or run[3] != gen:
                continue  # finished, or admitted again since
            stored = self.store(run[2][: block + 1], block)
            if locks is None:
                for lock in stored:
                    self.tree.unlock(lock)
            else:
                locks += stored
            self._planned[seq] = block + 1
            self._schedule_decode(seq, block + 1)

    def finish(self, f: FinishStep) -> None:
        self._store_decoded(f.step - 1)
        self._decoding.pop(f.seq, None)
        for lock in self.store(f.chain, self._planned.pop(f.seq, f.first_new)):
            self.tree.unlock(lock)
        self._fetched.pop(f.seq, None)
        self._arrived.discard(f.seq)

    def store(self, chain: Chain, lo: int, priority: int = 0) -> list[LockHandle]:
        """L2StorePlanner.store_range of blocks [lo, len(chain)), then their backup;
        returns the lock that pins what it stored (none if nothing)."""
        if not self.write.stores_on_compute or lo >= len(chain):
            return []
        self.write.record_use(chain[lo:])
        match = self.tree.match(chain)
        want = self.write.select(chain, match.missing(lo, len(chain)))
        if not want:
            return []
        with self._pinned(chain, match.num_blocks):
            pages = self.tree.alloc_up_to(len(want))
        want = want[: len(pages)]
        if not want:
            return []
        end = want[-1] + 1
        self._insert(chain[:end], want, pages, priority)
        return [self.tree.lock(chain, end)]

    def write_back(self, chain: Chain) -> None:
        """WriteBackWatcher._store: an evicted L1 block gets an L2 page."""
        matched = self.tree.match(chain).pages
        if len(matched) == len(chain) and matched[-1] is not None:
            return
        with self._pinned(chain, len(matched)):
            pages = self.tree.alloc(1)
        if pages is not None:
            self._insert(chain, [len(chain) - 1], pages, 0)

    def _insert(self, chain: Chain, blocks: list[int], pages: list[int], priority: int) -> None:
        new: list[int | None] = [None] * len(chain)
        for i, page in zip(blocks, pages):
            new[i] = page
        unused = self.tree.insert(chain, new, priority)
        assert not unused, unused
        self.result.stored_pages += len(pages)
        if self.boundary is not None:
            self.boundary.stored(chain, blocks)

    @contextmanager
    def _pinned(self, chain: Chain, num_matched: int) -> Iterator[None]:
        """Pin the matched prefix of ``chain`` while allocating (which may evict)."""
        lock = self.tree.lock(chain, num_matched) if num_matched else None
        try:
            yield
        finally:
            if lock is not None:
                self.tree.unlock(lock)


def replay(steps: list[Step], cfg: ReplayConfig) -> ReplayResult:
    """Replay ``l1_pass``'s steps through L2 and L3 of one size."""
    tiers = Hierarchy(cfg)
    write_back = cfg.write_policy == WritePolicyName.WRITE_BACK
    # The batch of one step: arrivals or admissions, never both at once.
    arrivals: list[ArriveStep] = []
    admits: list[AdmitStep] = []

    def end_batch() -> None:
        if arrivals:
            tiers.arrive_step(arrivals)
            arrivals.clear()
        if admits:
            tiers.admit_step(admits)
            if write_back:
                for chain in (c for adm in admits for c in adm.evicted):
                    tiers.write_back(chain)
            admits.clear()

    for step in steps:
        if isinstance(step, FinishStep):
            end_batch()
            tiers.finish(step)
            if write_back:
                for chain in step.evicted:
                    tiers.write_back(chain)
            continue
        batch: list[ArriveStep] | list[AdmitStep] = arrivals or admits
        if batch and (type(batch[0]) is not type(step) or _step_of(batch[0]) != _step_of(step)):
            end_batch()
        if isinstance(step, ArriveStep):
            arrivals.append(step)
        else:
            admits.append(step)
    end_batch()
    return tiers.result


def _step_of(s: ArriveStep | AdmitStep) -> int:
    return s.step if isinstance(s, ArriveStep) else s.record.step
