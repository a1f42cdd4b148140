"""The replay's L2 -> L3 boundary: hicache_l3_admission and hicache_l3_mode,
as l3/planner.py, l3/admission.py and l3/victims.py apply them, counting the
objects written to L3 (``ReplayResult.l3_written``).

Uses are counted as the engine counts them: the request that computed a
block (its store to L2) and every request whose hit covered it, once per
request (a request that hit a block in vLLM's cache and stores it again
because L2 lost it used it once).

- inclusive: a block goes to L3 when L2 stores it, if the rule admits it
  then; a declined block still in L2 goes once a later hit makes the rule
  admit it.
- exclusive: a block L2 stored goes to L3 when L2 evicts it, if the rule
  admits it then. The engine writes it before the page is freed; the replay
  at once (no write in flight, as for inclusive backups). A block promoted
  from L3 is not written again (it stays in L3, see l3/victims.py). Under
  ``value:V`` a written block's prefix, still in L2 (eviction is
  leaf-first), is written too when it leaves.

Writes of an object L3 already has cost nothing and are not counted.
Pure module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from vllm_hicache.planner.model import L3Store, ReplayConfig, ReplayResult
from vllm_hicache.policy.admission import Admission, AdmissionKind, L3Mode
from vllm_hicache.policy.write import hit_counter_slots

# match(chain) -> L2's pages of the chain's longest prefix (None: placeholder).
Match = Callable[[Sequence[bytes]], "list[int | None]"]


class L3Boundary:
    def __init__(self, cfg: ReplayConfig, l3: L3Store, result: ReplayResult,
                 match: Match) -> None:
        self.l3 = l3
        self.result = result
        self._match = match
        self.exclusive = cfg.l3_mode == L3Mode.EXCLUSIVE
        self._admission = Admission(cfg.l3_admission, hit_counter_slots(cfg.l2_pages),
                                    cfg.block_size)
        self._closure = cfg.l3_admission.kind == AdmissionKind.VALUE
        self._max_declined = max(1, cfg.l2_pages)
        # inclusive: declined block -> its chain (bounded, oldest dropped).
        self._declined: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        # exclusive: a block L2 stored -> (its index in its chain, its parent).
        self._held: dict[bytes, tuple[int, bytes | None]] = {}
        self._forced: set[bytes] = set()
        # Blocks the current step's admissions hit (``used``), until ``step_done``.
        self._used_now: set[bytes] = set()

    def step_done(self) -> None:
        """The step's admissions and their stores are over."""
        self._used_now.clear()

    def _write(self, hashes: Sequence[bytes]) -> None:
        self.result.l3_written += self.l3.write(hashes)
        self.result.l3_peak_objects = max(self.result.l3_peak_objects, len(self.l3))

    def stored(self, chain: Sequence[bytes], blocks: Sequence[int]) -> None:
        """L2 stored blocks ``blocks`` of ``chain`` (computed by one request)."""
        adm = self._admission
        # A block this step's admissions counted as a hit is stored again by
        # the request that hit it (L2 lacked it): not a second use.
        adm.record_use(chain[i] for i in blocks if chain[i] not in self._used_now)
        if self.exclusive:
            for i in blocks:
                self._held[chain[i]] = (i, chain[i - 1] if i else None)
            return
        admitted = adm.select(chain, list(blocks))
        self._write([chain[i] for i in admitted])
        if len(admitted) < len(blocks):
            keep = set(admitted)
            for i in blocks:
                if i not in keep:
                    self._declined[chain[i]] = tuple(chain[: i + 1])
            while len(self._declined) > self._max_declined:
                self._declined.popitem(last=False)

    def used(self, chain: Sequence[bytes]) -> None:
        """A request's hit covered every block of ``chain``."""
        adm = self._admission
        adm.record_use(chain)
        self._used_now.update(chain)
        if self.exclusive or not self._declined:
            return
        candidates = [i for i, h in enumerate(chain) if h in self._declined]
        for i in adm.select(chain, candidates):
            held = self._declined.pop(chain[i])
            pages = self._match(held)
            if len(pages) == len(held) and pages[-1] is not None:
                self._write([held[-1]])

    def evicted(self, hashes: Sequence[bytes]) -> None:
        """L2 evicted these blocks (the tree's on_evict)."""
        if not self.exclusive:
            for h in hashes:
                self._declined.pop(h, None)
            return
        adm = self._admission
        held = self._held
        # Deepest first, so a written block forces its prefix evicted with it.
        # (Blocks not held were promoted from L3: they stay there.)
        batch = sorted((h for h in hashes if h in held), key=lambda h: -held[h][0])
        out = []
        for h in batch:
            index, parent = held[h]
            forced = h in self._forced
            self._forced.discard(h)
            if forced or adm.rule.admits(adm.hits(h), (index + 1) * adm.block_size):
                out.append(h)
                if self._closure:
                    while parent is not None and parent in held and parent not in self._forced:
                        self._forced.add(parent)
                        parent = held[parent][1]
        for h in batch:
            del held[h]
        self._write(out)
