"""Per-request controls, read from the request's ``kv_transfer_params``.

A client sets them in the OpenAI request's ``kv_transfer_params`` object (or
``SamplingParams.extra_args["kv_transfer_params"]`` offline); vLLM hands them
to the connector as ``request.kv_transfer_params``. Names follow vLLM's own
connectors where vLLM has one:

- ``max_load_tokens`` (int >= 0): at most this many tokens of the request are
  loaded from HiCache (beyond vLLM's own prefix-cache hit); the L3 lookup is
  capped alike. vLLM's OffloadingConnector reads the same key.
- ``max_offload_tokens`` (int >= 0): only the request's first this many
  tokens are stored to L2 (and so backed up to L3). As in vLLM.
- ``hicache_tiers`` (list of "L2", "L3"): the tiers that may serve the
  request's loads. ``["L2", "L3"]`` (the default) uses both; ``["L2"]`` skips
  the L3 lookup and prefetch; ``[]`` loads nothing from HiCache. L3 data
  reaches vLLM through L2, so ``["L3"]`` alone is refused. Stores are
  governed by ``max_offload_tokens`` only.

The request's ``priority`` (vLLM's own field) feeds the ``priority`` eviction
policy; it is not a key here.

Other keys are left alone (another connector of a MultiConnector may read
them), except unknown ``hicache_*`` keys: a typo must not be silently ignored.
A bad value raises ``ValueError`` naming the key, the value and what is
accepted. Pure module: imports neither torch nor vllm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TIERS = ("L2", "L3")
_KNOWN_HICACHE_KEYS = ("hicache_tiers",)


@dataclass(frozen=True, slots=True)
class RequestControls:
    # Most tokens loaded from HiCache for this request; None: no cap.
    max_load_tokens: int | None = None
    # Tokens [0, max_offload_tokens) may be stored; None: no cap.
    max_offload_tokens: int | None = None
    # Tiers that may serve loads.
    tiers: frozenset[str] = frozenset(TIERS)

    @property
    def loads_l2(self) -> bool:
        return "L2" in self.tiers

    @property
    def looks_up_l3(self) -> bool:
        return "L3" in self.tiers

    def load_block_cap(self, block_size: int) -> int | None:
        """Most blocks a load may cover, or None."""
        if self.max_load_tokens is None:
            return None
        return self.max_load_tokens // block_size

    def store_block_limit(self, block_size: int) -> int | None:
        """Blocks [0, limit) may be stored, or None: no limit."""
        if self.max_offload_tokens is None:
            return None
        return self.max_offload_tokens // block_size


DEFAULT_CONTROLS = RequestControls()
# For a request whose controls could not be read: HiCache neither loads nor
# stores anything for it (an unreadable restriction is not ignored).
NO_HICACHE = RequestControls(max_load_tokens=0, max_offload_tokens=0, tiers=frozenset())


def parse_request_params(params: Mapping[str, Any] | None) -> RequestControls:
    """The controls in ``kv_transfer_params``; ValueError names a bad key."""
    if not params:
        return DEFAULT_CONTROLS
    if not isinstance(params, Mapping):
        raise ValueError(f"invalid kv_transfer_params={params!r}; expected an object")
    unknown = sorted(k for k in params if isinstance(k, str) and k.startswith("hicache_")
                     and k not in _KNOWN_HICACHE_KEYS)
    if unknown:
        raise ValueError(f"unknown kv_transfer_params key(s) {unknown}; HiCache accepts "
                         f"max_load_tokens, max_offload_tokens, {', '.join(_KNOWN_HICACHE_KEYS)}")
    max_load = _token_count(params, "max_load_tokens")
    max_offload = _token_count(params, "max_offload_tokens")
    tiers = _tiers(params.get("hicache_tiers"))
    if max_load is None and max_offload is None and tiers is None:
        return DEFAULT_CONTROLS
    return RequestControls(max_load, max_offload, tiers if tiers is not None else frozenset(TIERS))


def _token_count(params: Mapping[str, Any], key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    # bool is an int in Python; "true" tokens is a client bug.
    if type(value) is not int or value < 0:
        raise ValueError(f"invalid kv_transfer_params {key}={value!r}; expected an integer >= 0 "
                         "(a number of tokens)")
    return value


def _tiers(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"invalid kv_transfer_params hicache_tiers={value!r}; expected a list "
                         f"of tiers, each one of {', '.join(TIERS)} (e.g. [\"L2\", \"L3\"])")
    bad = [t for t in value if t not in TIERS]
    if bad:
        raise ValueError(f"invalid kv_transfer_params hicache_tiers={value!r}: {bad} not a tier; "
                         f"accepted: {', '.join(TIERS)}")
    tiers = frozenset(value)
    if tiers == {"L3"}:
        raise ValueError("invalid kv_transfer_params hicache_tiers=['L3']: L3 data is loaded "
                         "through L2; use [\"L2\", \"L3\"], [\"L2\"] or [] (no HiCache loads)")
    return tiers
