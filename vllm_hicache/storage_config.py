"""The L3 part of the configuration: ``hicache_storage_*`` keys.

``hicache_storage_backend_extra_config`` is a dict, a JSON string, or
``@path`` to a ``.json`` or ``.toml`` file (as SGLang's flag). The prefetch
knobs are taken out of it here, SGLang-style (parsed by their fields'
parsers, storage/options.py); what remains is the backend's own options,
which the backend validates when it is built. So are the security options
every backend shares: ``storage_secret`` (authenticated objects;
storage_secret.py) and ``storage_encrypt`` (encrypted payloads); the secret
never reaches a backend, a repr or an error message, nor do the backend's
inline secrets (its repr shows them redacted, redaction.py). The accepted backend
names are the registry's (storage/factory.py). Pure module.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hicache.option_file import read_option_file
from vllm_hicache.policy.prefetch import (
    PREFETCH_POLICIES,
    PREFETCH_THRESHOLD_AUTO,
    PrefetchPolicyName,
    parse_prefetch_threshold,
)
from vllm_hicache.policy.same_step import MAX_SAME_STEP_WAIT_MS, check_same_step_policy
from vllm_hicache.policy.write_budget import WriteBudgetConfig
from vllm_hicache.redaction import redacted
from vllm_hicache.storage.factory import backend_names
from vllm_hicache.storage.options import (
    integer,
    number,
    option,
    parse_value,
    size,
)
from vllm_hicache.storage_secret import LABEL_OBJECT_NAMES, StorageSecret
from vllm_hicache.storage_secret import OPTION as SECRET_OPTION

# The backends registered at import (the registry's names, for the admin API);
# parse_storage asks the registry itself.
STORAGE_BACKENDS = backend_names()
STORAGE_KEYS = (
    "hicache_storage_backend",
    "hicache_storage_prefetch_policy",
    "hicache_storage_backend_extra_config",
)

# The backend a node tier runs on when no hicache_storage_backend is set:
# the node tier alone, with no remote store behind it (storage/node_chain.py).
NODE_ONLY_BACKEND = "node-tier-only"


@dataclass(frozen=True)
class StorageConfig:
    """The L3 tier: ``hicache_storage_*`` keys (None in HiCacheConfig = no L3)."""

    # Registry name of the backend (SGLang --hicache-storage-backend).
    backend: str
    # When a request may wait for its L3 -> L2 prefetch
    # (SGLang --hicache-storage-prefetch-policy).
    prefetch_policy: PrefetchPolicyName = PrefetchPolicyName.BEST_EFFORT
    # Which L3 hits are prefetched (policy/prefetch.py): "auto" = those the
    # load decision's cost model expects to load faster than vLLM computes
    # them, of any length; an integer = those of at least that many tokens.
    prefetch_threshold: int | str = option(PREFETCH_THRESHOLD_AUTO,
                                           parse=parse_prefetch_threshold)
    # timeout policy: wait base + per_ki_token x tokens/1024 seconds, capped.
    prefetch_timeout_base: float = option(2.0, parse=number(0.0))
    prefetch_timeout_per_ki_token: float = option(0.1, parse=number(0.0))
    prefetch_timeout_max: float = option(30.0, parse=number(0.0))
    # Same-step admission (l3/same_step.py): > 0 admits an L3 hit in the
    # step its read is sent, each worker's L1 copy waiting at most this long
    # for the read (a page not read by then is a load error, recomputed).
    # 0 = off: the hit is admitted the step after its read is reported.
    same_step_read_wait_ms: float = option(0.0, parse=number(0.0, MAX_SAME_STEP_WAIT_MS))
    # Heterogeneous TP (SGLang's tp_lcm_size): objects hold 1/tp_lcm_size of
    # the model's KV heads each, keyed by slice rather than by TP rank, so
    # instances whose TP sizes divide it share objects. 0 = off (one object
    # per TP rank). Checked against the model and TP size at start
    # (keys.check_head_slicing).
    tp_lcm_size: int = option(0, parse=integer(0))
    # Write budgets on L2 -> L3 backups (policy/write_budget.py), in bytes
    # of L3 objects (all ranks' together): backups over budget are skipped,
    # least valuable first, never waited for. 0 = no cap.
    l3_write_budget_bytes_per_s: int = option(0, parse=size(0))
    # The bucket's depth: bytes writable at once after an idle spell; 0 =
    # one second of l3_write_budget_bytes_per_s.
    l3_write_burst_bytes: int = option(0, parse=size(0))
    l3_write_budget_bytes_per_day: int = option(0, parse=size(0))
    # Everything else in hicache_storage_backend_extra_config: the backend's
    # own options, validated by the backend when it is built.
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # storage_secret: every object carries a MAC keyed by it, and its one-way
    # tag is in every key; None = checksums only. Never shown.
    secret: StorageSecret | None = dataclasses.field(default=None, repr=False)
    # storage_encrypt: payloads are AES-256-GCM ciphertext (needs the secret).
    encrypt: bool = False

    def __repr__(self) -> str:
        # Inline backend secrets (a Redis password, S3 keys) shown redacted.
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}
        values["backend_options"] = redacted(dict(self.backend_options))
        return f"StorageConfig({', '.join(f'{k}={v!r}' for k, v in values.items())})"

    @property
    def write_budget(self) -> WriteBudgetConfig:
        return WriteBudgetConfig(self.l3_write_budget_bytes_per_s, self.l3_write_burst_bytes,
                                 self.l3_write_budget_bytes_per_day)

    @property
    def protection(self) -> str:
        """How objects are sealed (sealing.py's codec names): "checksum",
        "gmac" or "aead"."""
        if self.secret is None:
            return "checksum"
        return "aead" if self.encrypt else "gmac"

    @property
    def object_name_key(self) -> bytes:
        """The key object names are hashed with (keys.KeyNamespace.name_key):
        b"" without a secret. Derived from the secret, never the secret."""
        return b"" if self.secret is None else self.secret.derive(LABEL_OBJECT_NAMES)

    @property
    def key_protection(self) -> str:
        """What object keys say about the sealing (KeyNamespace.protection):
        "" without a secret, else the mode and the secret's one-way tag."""
        if self.secret is None:
            return ""
        return f"{self.protection}:{self.secret.namespace_tag}"


def parse_storage(keys: Mapping[str, Any],
                  default_backend: str | None = None) -> StorageConfig | None:
    """Build the StorageConfig from the ``hicache_storage_*`` keys given;
    ``default_backend`` (NODE_ONLY_BACKEND with a node tier) stands in for
    an absent hicache_storage_backend."""
    if not keys and default_backend is None:
        return None
    backend = keys.get("hicache_storage_backend", default_backend)
    if backend is None:
        raise ValueError(
            f"{sorted(keys)} given without hicache_storage_backend; set it to one of "
            f"{', '.join(backend_names())} or remove them"
        )
    if "hicache_storage_backend" in keys:
        _check_choice("hicache_storage_backend", backend, backend_names())
    policy = keys.get("hicache_storage_prefetch_policy", PrefetchPolicyName.BEST_EFFORT)
    _check_choice("hicache_storage_prefetch_policy", policy, PREFETCH_POLICIES)
    policy = PrefetchPolicyName(policy)
    options = _load_extra(keys.get("hicache_storage_backend_extra_config"))
    knobs = {name: parse_value(_EXTRA, _KNOBS[name], options.pop(name))
             for name in _KNOBS if name in options}
    if knobs.get("l3_write_burst_bytes") and not knobs.get("l3_write_budget_bytes_per_s"):
        raise ValueError(
            f"l3_write_burst_bytes set in {_EXTRA} without l3_write_budget_bytes_per_s: a "
            "burst is the depth of a bandwidth budget; set the budget too or remove it")
    check_same_step_policy(knobs.get("same_step_read_wait_ms", 0.0), policy)
    secret, encrypt = _pop_security(options)
    return StorageConfig(
        backend=backend, prefetch_policy=policy,
        backend_options=types.MappingProxyType(options), secret=secret, encrypt=encrypt,
        **knobs,
    )


def _pop_security(options: dict[str, Any]) -> tuple[StorageSecret | None, bool]:
    secret = None
    if SECRET_OPTION in options:
        secret = StorageSecret.from_option(options.pop(SECRET_OPTION))
    encrypt = options.pop("storage_encrypt", False)
    if not isinstance(encrypt, bool):
        raise ValueError(
            f"invalid storage_encrypt={encrypt!r} in hicache_storage_backend_extra_config; "
            "expected true or false"
        )
    if encrypt and secret is None:
        raise ValueError(
            "storage_encrypt=true needs storage_secret in hicache_storage_backend_extra_config "
            "(the encryption key is derived from it); set storage_secret to @/path/to/file"
        )
    return secret, encrypt


# The prefetch knobs: the StorageConfig fields with a parser, taken out of the
# extra config.
_EXTRA = "hicache_storage_backend_extra_config"
_KNOBS = {f.name: f for f in dataclasses.fields(StorageConfig) if "parse" in f.metadata}


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
        raise ValueError(f"invalid {key} of type {type(value).__name__}; expected a dict, "
                         "JSON or @file")
    # Errors show a file's name, never inline JSON: it may hold a secret.
    shown = repr(value) if value.startswith("@") else f"(a JSON string of {len(value)} chars)"
    try:
        loaded = _load_file(value[1:]) if value.startswith("@") else json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid {key} {shown}: {err.msg} at line {err.lineno} column "
                         f"{err.colno}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"invalid {key} {shown}: {err}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"invalid {key} {shown}; expected a JSON object")
    return loaded


def _load_file(path: str) -> Any:
    suffix = Path(path).suffix
    if suffix not in (".json", ".toml"):
        raise ValueError(f"unsupported file type {suffix!r}: use .json or .toml")
    try:
        text = read_option_file(path).decode("utf-8")
    except UnicodeError:
        raise ValueError("not UTF-8 text") from None
    if suffix == ".json":
        return json.loads(text)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ValueError("a .toml file needs Python >= 3.11; use .json") from None
    return tomllib.loads(text)
