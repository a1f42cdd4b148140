"""Scheduler half of the L3 tier, its backups: which pages stored to L2 are
written to L3, when, and what is known once every rank acknowledged. The
planner (l3/planner.py) owns one ``L3Backups`` (``planner.backups``, which
callers use directly; the planner's ``plan_backups`` announces the step's
removals first); lookups and prefetches stay the planner's.

Invariant: every page of a backup sent to the workers is pinned by its
BACKUP op (common/page_ops.py) until every rank has acknowledged it; a
deferred backup pins nothing (it is re-read from the tree when flushed,
and what left L2 meanwhile is counted as evicted); nothing planned exceeds
the write budget.

Which stored pages are backed up, and when, is the L2 -> L3 boundary's
admission rule (l3/admission.py) and mode: inclusive (the default) backs a
page up when L2 stores it; exclusive (l3/victims.py) holds it in L2 and
backs it up when L2 needs its room.

Backups are bounded (policy/offload.py): a step's stored pages are backed
up at once while fewer than ``max_backup_pages`` pages are unacknowledged
(so the bound is overshot by one step's stores at most); otherwise they are
deferred to a bounded backlog (unpinned), flushed most valuable first as
acknowledgements make room, which keeps an idle engine stepping until it is
empty.

While the circuit breaker is not closed, stored pages are not backed up and
the backlog is dropped (both counted in ``breaker_skipped_blocks``); backups
already sent end as they would.

Write budgets (policy/write_budget.py, ``l3_write_budget_*``): what a
step would back up (its stores and the backlog's flush) is cut to what the
budget allows now, least valuable blocks skipped (not deferred: a budget
that is behind would otherwise grow a backlog it never drains), counted by
the limit that skipped them; the attach backfill takes only what the
budget allows and waits for the rest. Every backup op opened spends the
budget, so nothing planned exceeds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from vllm_hicache.common.events import MEDIUM_L3, EventLog
from vllm_hicache.common.jobs import BackupJob
from vllm_hicache.common.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.admission import L3Admission
from vllm_hicache.l3.backup_budget import BackupBudget
from vllm_hicache.l3.removals import RemovedKeys
from vllm_hicache.l3.victims import VictimHolds, reserve_pages
from vllm_hicache.policy.admission import AdmissionRule, L3Mode
from vllm_hicache.policy.offload import BackupBacklog, backup_inflight_cap
from vllm_hicache.policy.write import hit_counter_slots
from vllm_hicache.policy.write_budget import WriteBudgetConfig
from vllm_hicache.storage import StorageBackend

# pick(tree, room): up to ``room`` blocks of L2 pages to back up now.
PickL2Only = Callable[[HiRadixTree, int], "list[PinnedRange]"]


class BackupContext(Protocol):
    """The scheduler half's state backups act on: its L2 index and page
    operations (the planner's PlannerContext; named here without importing
    the planner, which imports this module)."""

    tree: HiRadixTree
    ops: PageOps


class L3Backups:
    """The backup ops of one L3 planner (one backend generation)."""

    def __init__(self, ctx: BackupContext | None, backend: StorageBackend,
                 removals: RemovedKeys, block_size: int, world_size: int,
                 max_inflight_pages: int, max_backup_pages: int | None,
                 page_states: PageStates | None, admission: AdmissionRule, mode: L3Mode,
                 write_budget: WriteBudgetConfig, block_bytes: int) -> None:
        # None: a planner that only names keys and looks up (tools, tests).
        self.ctx = ctx
        self.backend = backend  # its name owns the BlockStored events
        # Shared with the planner's prefetches: every key this planner
        # writes or reads maps back to its block hash (l3/removals.py).
        self.removals = removals
        self.page_states = page_states
        self.world_size = world_size
        self.max_inflight_pages = max_inflight_pages
        # The backend generation the jobs belong to (set_generation).
        self.generation = 0
        self._backups: dict[int, PageOp] = {}
        self._backup_acks: dict[int, set[int]] = {}
        self.backed_up_blocks = 0
        # Blocks the breaker kept from L3 (stored while open, the backlog dropped).
        self.breaker_skipped_blocks = 0
        # Open backup -> hashes some rank failed to write (kv_events.py).
        self._backup_failures: dict[int, set[bytes]] = {}
        # Backpressure (policy/offload.py): pages of open backups, the bound,
        # and the deferred ones.
        self.max_backup_pages = (max_backup_pages if max_backup_pages is not None
                                 else backup_inflight_cap(max_inflight_pages))
        self._backup_pages = 0
        self._bounded: dict[int, int] = {}  # backup op -> its pages counted in _backup_pages
        self.backlog = BackupBacklog(max(1, max_inflight_pages))
        self.backup_deferred = 0
        self.backup_flushed = 0
        self.backup_dropped = 0
        self.backup_evicted = 0
        # hicache_l3_admission and hicache_l3_mode (module doc).
        l2_pages = ctx.tree.num_pages if ctx is not None else max_inflight_pages
        self.admission = L3Admission(admission, hit_counter_slots(l2_pages), block_size,
                                     max(1, l2_pages))
        self.victims: VictimHolds | None = None
        if mode == L3Mode.EXCLUSIVE and ctx is not None:  # without one it plans nothing
            self.victims = VictimHolds(ctx.ops, reserve_pages(l2_pages))
        self.victim_written_blocks = 0  # held blocks whose backup was opened
        # Blocks noted as hits since the last plan_backups: the request that
        # hit one and stores it again (L2 lacked it) is not a second use.
        self._used_this_step: set[bytes] = set()
        # Write budgets (l3/backup_budget.py; a block's worth comes from the
        # admission's use counts).
        self.budget = BackupBudget(write_budget, block_bytes)
        # Blocks every rank acknowledged as written (a graceful stop counts them).
        self.written_blocks = 0

    def _context(self) -> BackupContext:
        """The scheduler state; planning or completing backups without it is a bug."""
        if self.ctx is None:
            raise RuntimeError("this L3Planner was built without a PlannerContext "
                               "(lookups only): it cannot plan or complete page ops")
        return self.ctx

    def drop_for_breaker(self) -> None:
        """The breaker tripped: the backlog would use the store later; drop it, counted."""
        self.breaker_skipped_blocks += self.backlog.num_blocks
        self.backlog = BackupBacklog(max(1, self.max_inflight_pages))

    def plan_backup(self, stored: list[PinnedRange], step: int) -> list[BackupJob]:
        """One backup op for this step's stored pages (their STORE ops pin
        them now; the BACKUP op keeps them pinned until every rank acked)."""
        if not stored:
            return []
        op = self._context().ops.open(OpKind.BACKUP, step, stored)
        hashes = tuple(r.chain[i] for r in stored for i in r.blocks)
        pages = tuple(p for r in stored for p in r.pages)
        states = (tuple(map(self.page_states.valid, pages)) if self.page_states is not None
                  else ())
        self._backups[op.op_id] = op
        self.backed_up_blocks += len(pages)
        self.removals.note(hashes)
        self.budget.spend(len(pages))
        return [BackupJob(op.op_id, hashes, pages, states, self.generation)]

    def plan_backups(self, stored: list[PinnedRange], step: int, usable: bool,
                     pick: PickL2Only | None = None) -> list[BackupJob]:
        """L3Planner.plan_backups, once the step's removals are announced;
        ``usable``: the breaker lets this step use the store."""
        self.admission.count_stored(stored, self._used_this_step)
        self._used_this_step = set()
        if self.victims is not None:
            return self._plan_victims(stored, step, write=usable, drain=pick is not None)
        if not usable:
            self.breaker_skipped_blocks += sum(len(r.blocks) for r in stored)
            return []
        if not self.admission.admits_all:
            stored = self.admission.filter(stored)
            stored += self.admission.take_admitted(self._context().tree)
        room = self.max_backup_pages - self._backup_pages
        now: list[PinnedRange] = []
        if room > 0:
            now = list(stored)
            room -= sum(len(r.blocks) for r in stored)
        else:
            for rng in stored:
                self.backup_deferred += len(rng.blocks)
                self.backup_dropped += self.backlog.defer(rng.chain, rng.blocks)
        if room > 0 and pick is not None:
            now += pick(self._context().tree, room)
        elif room > 0 and len(self.backlog):
            now += self._flush(self._context().tree, room)
        jobs = self.plan_backup(self.budget.cut(now, self.admission.hits), step)
        for job in jobs:  # the bound counts these; an attach's backfill has its own
            self._bounded[job.op_id] = len(job.pages)
            self._backup_pages += len(job.pages)
        return jobs

    def _plan_victims(self, stored: list[PinnedRange], step: int,
                      write: bool = True, drain: bool = False) -> list[BackupJob]:
        """Exclusive mode: hold what L2 stored; back up (or, declined,
        release) the oldest holds while L2 is short of evictable pages.
        Never deferred: a deferred page would be evictable before its write.
        ``write`` False (the breaker is not closed): released unwritten, and
        counted as skipped by the breaker. ``drain`` (a graceful stop): every
        hold is released, oldest first, as fast as the in-flight bound allows."""
        victims = self.victims
        assert victims is not None
        tree = self._context().tree
        victims.hold(stored, step)
        jobs: list[BackupJob] = []
        if not write:
            short = victims.deficit(tree)
            if short > 0:
                declined = victims.num_declined
                victims.release(short, tree, lambda chain, blocks: [], lambda ranges: None, short)
                self.breaker_skipped_blocks += victims.num_declined - declined
            return jobs

        def backup(ranges: list[PinnedRange]) -> None:  # over budget: released unwritten
            for job in self.plan_backup(self.budget.cut(ranges, self.admission.hits), step):
                self.victim_written_blocks += len(job.pages)
                self._bounded[job.op_id] = len(job.pages)
                self._backup_pages += len(job.pages)
                jobs.append(job)

        short = len(victims) if drain else victims.deficit(tree)
        if short > 0:
            victims.release(short, tree, self.admission.select, backup,
                            self.max_backup_pages - self._backup_pages)
        return jobs

    def release_l2(self) -> int:
        """Hold no L2 page any more (L2 is being cleared, or this planner
        detached); blocks released unwritten."""
        self.admission.clear()
        return self.victims.release_all() if self.victims is not None else 0

    def l2_only_by_value(self) -> list[tuple[tuple[bytes, ...], int, int]]:
        """Blocks L2 holds that L3 lacks as far as this planner knows, as
        (chain through the block, page, value), most valuable first: what a
        graceful stop writes out, within its budget. Exclusive mode: every
        held block; inclusive: the deferred backups still in L2."""
        if self.victims is not None:
            return self.victims.l2_only_by_value(self.admission.value)
        tree = self._context().tree
        out = []
        for entry in self.backlog.entries():
            pages = tree.match(entry.chain).pages
            for b in entry.blocks:
                page = pages[b] if b < len(pages) else None
                if page is not None:
                    out.append((entry.chain[: b + 1], page,
                                self.admission.value(entry.chain, b)))
        out.sort(key=lambda item: -item[2])
        return out

    def check(self) -> list[str]:
        """Problems with what this planner holds in L2 (empty when all is well)."""
        return self.victims.check() if self.victims is not None else []

    def take_backlog(self, tree: HiRadixTree, room: int) -> list[PinnedRange]:
        """Up to ``room`` deferred blocks whose pages are still in L2, most valuable first."""
        return self._flush(tree, room)

    def _flush(self, tree: HiRadixTree, room: int) -> list[PinnedRange]:
        """Up to ``room`` deferred blocks whose pages are still in L2."""
        ranges = []
        for entry in self.backlog.take(room):
            pages = tree.match(entry.chain).pages
            picked = [(b, page) for b, page in
                      ((b, pages[b]) for b in entry.blocks if b < len(pages))
                      if page is not None]
            self.backup_evicted += len(entry.blocks) - len(picked)
            if picked:
                blocks = tuple(b for b, _ in picked)
                self.backup_flushed += len(blocks)
                ranges.append(PinnedRange(entry.chain[: blocks[-1] + 1], blocks,
                                          tuple(page for _, page in picked)))
        return ranges

    def flush_backlog(self, step: int) -> list[BackupJob]:
        """Every deferred block still in L2, as one backup op, whatever is in
        flight: a replaced backend's last backups (l3/retiring.py)."""
        if not len(self.backlog):
            return []
        return self.plan_backup(self._flush(self._context().tree, self.backlog.num_blocks),
                                step)

    def budget_blocks(self) -> int | None:
        """Blocks the write budget lets a backup write now; None: no budget."""
        return self.budget.blocks_now()

    def open_backup_blocks(self) -> int:
        """Blocks of backups not yet acknowledged by every rank."""
        return sum(len(rng.blocks) for op in self._backups.values() for rng in op.ranges)

    def drop_backlog(self) -> int:
        """Forget every deferred backup (a stop ran out of time); returns the blocks."""
        return self.backlog.clear()

    def note_use(self, hashes) -> None:
        """A request used these blocks (its hit): deferred backups and held
        pages of them gain value, declined ones may now be admitted."""
        self.backlog.record_use(hashes)
        self.admission.record_use(hashes)
        self._used_this_step.update(hashes)
        if self.victims is not None:
            self.victims.note_use(hashes)

    def is_backup_open(self, op_id: int) -> bool:
        return op_id in self._backups

    def num_open(self) -> int:
        """Backup ops sent to the workers and not acknowledged by all."""
        return len(self._backups)

    def open_backup_pages(self) -> int:
        """Pages of backups sent to the workers and not acknowledged by all."""
        return sum(len(rng.pages) for op in self._backups.values() for rng in op.ranges)

    # --- completions -------------------------------------------------------

    def on_reports(self, failures: Mapping[int, Iterable[bytes]],
                   acks: Mapping[int, set[int]], ops: PageOps,
                   events: EventLog | None) -> None:
        """A step's worker reports: hashes some rank failed to write, then
        the ranks that acknowledged each backup."""
        for op_id, hashes in failures.items():
            if op_id in self._backups:  # reported before (or with) that rank's ack
                self._backup_failures.setdefault(op_id, set()).update(hashes)
        for op_id, ranks in acks.items():
            self._ack_backup(op_id, ranks, ops, events)

    def fail_removed(self, gone: set[bytes]) -> None:
        """Blocks ``gone`` left L3: keep them out of the BlockStored of backups still open."""
        for op_id, op in self._backups.items():
            hit = gone.intersection(rng.chain[i] for rng in op.ranges for i in rng.blocks)
            if hit:
                self._backup_failures.setdefault(op_id, set()).update(hit)

    def _ack_backup(self, op_id: int, ranks: set[int], ops: PageOps,
                    events: EventLog | None = None) -> None:
        if op_id not in self._backups:
            return  # a duplicate or late ack of a finished backup
        acked = self._backup_acks.setdefault(op_id, set())
        acked |= ranks
        if len(acked) >= self.world_size:
            del self._backup_acks[op_id]
            op = self._backups.pop(op_id)
            self._backup_pages -= self._bounded.pop(op_id, 0)
            failed = self._backup_failures.pop(op_id, ())
            self.written_blocks += sum(rng.chain[i] not in failed
                                       for rng in op.ranges for i in rng.blocks)
            if events is not None and events.enabled:
                for rng in op.ranges:
                    blocks = [i for i in rng.blocks if rng.chain[i] not in failed]
                    events.stored(MEDIUM_L3, rng.chain, blocks, ownership=self.backend.name)
            ops.close(op)

