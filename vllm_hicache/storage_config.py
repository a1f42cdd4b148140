"""The L3 part of the configuration: ``hicache_storage_*`` keys.

``hicache_storage_backend_extra_config`` is a dict, a JSON string, or
``@path`` to a ``.json`` or ``.toml`` file (as SGLang's flag). The prefetch
knobs are taken out of it here, SGLang-style; what remains is the backend's
own options, which the backend validates when it is built. Pure module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STORAGE_BACKENDS = ("file", "redis", "mooncake", "nixl", "dynamic")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_KEYS = (
    "hicache_storage_backend",
    "hicache_storage_prefetch_policy",
    "hicache_storage_backend_extra_config",
)
# The L3 tier is wired into the connector only when this is True; until then
# its keys are refused rather than accepted and ignored.
L3_ENABLED = True


@dataclass(frozen=True)
class StorageConfig:
    """The L3 tier: ``hicache_storage_*`` keys (None in HiCacheConfig = no L3)."""

    # Registry name of the backend (SGLang --hicache-storage-backend).
    backend: str
    # When a request may wait for its L3 -> L2 prefetch
    # (SGLang --hicache-storage-prefetch-policy).
    prefetch_policy: str = "best_effort"
    # Shorter L3 hits (in tokens) are not prefetched.
    prefetch_threshold: int = 256
    # timeout policy: wait base + per_ki_token x tokens/1024 seconds, capped.
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_ki_token: float = 0.1
    prefetch_timeout_max: float = 30.0
    # Everything else in hicache_storage_backend_extra_config: the backend's
    # own options, validated by the backend when it is built.
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        wait = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * num_tokens / 1024
        return min(wait, self.prefetch_timeout_max)


def parse_storage(keys: Mapping[str, Any]) -> StorageConfig | None:
    """Build the StorageConfig from the ``hicache_storage_*`` keys given."""
    if not keys:
        return None
    backend = keys.get("hicache_storage_backend")
    if backend is None:
        raise ValueError(
            f"{sorted(keys)} given without hicache_storage_backend; set it to one of "
            f"{', '.join(STORAGE_BACKENDS)} or remove them"
        )
    _check_choice("hicache_storage_backend", backend, STORAGE_BACKENDS)
    if not L3_ENABLED:
        raise ValueError(
            f"hicache_storage_backend={backend!r} is not supported yet: the L3 storage "
            "tier is not wired into this version of vllm_hicache"
        )
    policy = keys.get("hicache_storage_prefetch_policy", "best_effort")
    _check_choice("hicache_storage_prefetch_policy", policy, PREFETCH_POLICIES)
    options = _load_extra(keys.get("hicache_storage_backend_extra_config"))
    knobs = {name: _pop_knob(options, name) for name in _KNOBS if name in options}
    return StorageConfig(
        backend=backend, prefetch_policy=policy,
        backend_options=types.MappingProxyType(options), **knobs,
    )


# knob -> (type, minimum)
_KNOBS = {
    "prefetch_threshold": (int, 1),
    "prefetch_timeout_base": (float, 0.0),
    "prefetch_timeout_per_ki_token": (float, 0.0),
    "prefetch_timeout_max": (float, 0.0),
}


def _pop_knob(options: dict[str, Any], name: str) -> int | float:
    kind, minimum = _KNOBS[name]
    value = options.pop(name)
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok_type = ok_type and float(value).is_integer()
    if not ok_type or not math.isfinite(value) or value < minimum:
        raise ValueError(
            f"invalid {name}={value!r} in hicache_storage_backend_extra_config; "
            f"expected {'an integer' if kind is int else 'a number'} >= {minimum}"
        )
    return kind(value)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"invalid {key}={value!r}; accepted: {', '.join(choices)}")


def _load_extra(value: Any) -> dict[str, Any]:
    key = "hicache_storage_backend_extra_config"
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"invalid {key}={value!r}; expected a dict, JSON or @file")
    try:
        loaded = _load_file(value[1:]) if value.startswith("@") else json.loads(value)
    except (OSError, ValueError) as err:
        raise ValueError(f"invalid {key}={value!r}: {err}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"invalid {key}={value!r}; expected a JSON object")
    return loaded


def _load_file(path: str) -> Any:
    suffix = Path(path).suffix
    if suffix == ".json":
        return json.loads(Path(path).read_text())
    if suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError("a .toml file needs Python >= 3.11; use .json") from None
        return tomllib.loads(Path(path).read_text())
    raise ValueError(f"unsupported file type {suffix!r}: use .json or .toml")
