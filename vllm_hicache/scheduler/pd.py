"""HiCache's role in a prefill/decode-disaggregated (PD) deployment.

Both kinds of instance run vLLM's ``MultiConnector`` with ``NixlConnector``
first and HiCache second (docs/pd.md). HiCache's
entry carries the instance's role in its ``kv_role``, like the NixlConnector
entry next to it, and ``config_finish.finish_config`` (its ``check_kv_role``) refuses
contradictions at start:

- ``PREFILL`` (``kv_role="kv_producer"``): HiCache works as on a single
  instance. A prefix in L1, L2 or L3 is loaded into vLLM's blocks before the
  rest of the prompt is computed, so NixlConnector sends decode the same
  blocks it would have sent after recomputing them.
- ``DECODE_OFFLOAD`` (``kv_role="kv_consumer"`` + ``hicache_decode_offload``):
  HiCache never looks anything up. Each request's full blocks, the prompt
  NixlConnector delivered and the generated tokens, are stored to L2 as they
  complete (the prompt's in the first step after delivery) and backed up to
  L3 by the usual background backups, where the next turn's prefill finds
  them. L2 is only the staging buffer of those backups: nothing reads it,
  and a page is evictable once its backup is acknowledged (a backup that
  cannot keep up defers or drops blocks, counted, rather than stall decode).
- ``SINGLE`` (``kv_role="kv_both"``): no PD.

Invariants that keep the hand-off untouched:

- A decode-offload instance reports no hit (``loads_hits`` is False: no L2
  lookup, no L3 lookup or prefetch), so MultiConnector always picks
  NixlConnector to load there, whatever the order of the entries, and decode
  computes from exactly what prefill sent.
- HiCache never delays freeing a request's blocks: ``request_finished``
  returns False, because its stores copy each block in the step that
  completed it, before vLLM can finish the request. Holding the blocks until
  decode has read them is NixlConnector's alone (its ``delay_free``), and
  MultiConnector counts one asynchronous save per request.
- The only key HiCache puts into a request's ``kv_transfer_params`` is
  ``hicache_error``, so it never clashes with NixlConnector's keys; it reads
  only ``hicache_*`` and its own controls, leaving NixlConnector's alone
  (request_params.py).

Pure module: imports neither torch nor vllm.
"""

from __future__ import annotations

import enum

from vllm_hicache.config import HiCacheConfig
from vllm_hicache.config_finish import check_kv_role


class PDRole(enum.Enum):
    SINGLE = "single"
    PREFILL = "prefill"
    DECODE_OFFLOAD = "decode offload"


def pd_role(cfg: HiCacheConfig, kv_role: str | None) -> PDRole:
    """The role HiCache's ``kv_role`` and options give it; ValueError (naming
    the keys) when they contradict."""
    check_kv_role(cfg, kv_role)
    if cfg.hicache_decode_offload:
        return PDRole.DECODE_OFFLOAD
    return PDRole.PREFILL if kv_role == "kv_producer" else PDRole.SINGLE


def loads_hits(cfg: HiCacheConfig) -> bool:
    """Does the scheduler half look up and load hits under ``cfg``?"""
    return not cfg.hicache_decode_offload
