"""HiCache configuration, parsed once from ``kv_connector_extra_config``.

Invariant: every key a user can set is read here and nowhere else, and every
decision about the configuration is taken here or in the two modules beside
it: config_admin.py (the admin API's value parsers) and config_finish.py
(fitting the configuration to one engine). Each key is a field of
``HiCacheConfig`` declared with ``option(default, parse=...)``
(storage/options.py, as the storage backends' options): its default, its
parser and its error live on the field. Unknown keys, wrong types and
out-of-range values raise ``ValueError`` naming the key, the value and what is
accepted. Keys mirror SGLang's ``--hicache-*`` flags; values with a fixed set
of names are str-valued enums owned by the floor that acts on them
(``host/``: layouts, ``kernels/``: copy backends, ``policy/``: policies).

Two steps, both pure:

- ``HiCacheConfig.parse`` (here) checks keys, values and the combinations
  that do not depend on the engine (admin API binding, decode offload).
- ``config_finish.finish_config`` takes the facts the connector extracts
  from vLLM and the platform and returns the configuration the engine runs
  with, plus the ``Rewrite`` s it made, or refuses a contradiction. The
  copy backend / host layout pair it settles is decided here
  (``resolve_pair``), as tools and tests need it without an engine.

``HiCacheConfig.from_extra_config`` (parse, then the platform-independent
rewrites, each logged: ``resolve_conflicts``) is for tools and tests. Pure
module: imports neither torch nor vllm.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vllm_hicache.config_admin import (
    ADMIN_KEY_AUTO,
    ADMIN_KEY_NONE,
    is_loopback,
    parse_admin_host,
    parse_admin_key,
    parse_admin_port,
    parse_dynamic_modules,
    parse_file_dirs,
    parse_key_dir,
)
from vllm_hicache.host.layout_names import MEM_LAYOUTS, MemLayout
from vllm_hicache.kernels.io_backends import IO_BACKENDS, IOBackend
from vllm_hicache.node import DEFAULT_ROOT as NODE_TIER_ROOT
from vllm_hicache.node import check_name as check_node_tier_name
from vllm_hicache.policy.admission import ALWAYS, AdmissionRule, L3Mode, parse_admission
from vllm_hicache.policy.eviction import EVICTION_POLICIES, EvictionPolicyName
from vllm_hicache.policy.load import LoadDecision
from vllm_hicache.policy.storage_switch import StorageSwitch
from vllm_hicache.policy.write import WritePolicyName, l2_admission_rule
from vllm_hicache.storage.options import (
    flag,
    named,
    number,
    option,
    parse_value,
    reject_unknown,
)
from vllm_hicache.storage_config import (
    NODE_ONLY_BACKEND,
    STORAGE_KEYS,
    StorageConfig,
    parse_storage,
)

__all__ = [
    "EVICTION_POLICIES", "IO_BACKENDS", "MEM_LAYOUTS", "HiCacheConfig", "LoadMode", "Rewrite",
    "resolve_conflicts", "resolve_pair",
]

logger = logging.getLogger(__name__)


class LoadMode(StrEnum):
    """hicache_load_mode's values (a str: compares and prints as its name)."""

    LAYERWISE = "layerwise"
    ASYNC = "async"


LOAD_MODES = tuple(LoadMode)

_GB = 1e9


# --- parsers (each raises ValueError saying what is accepted; parse_value
# --- prefixes the key and the value) -------------------------------------------


def _finite(value: Any) -> float:
    """An int, float or numeric string (SGLang's flags are strings), finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError("expected a number") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError("expected a finite number")
    return number


def _parse_ratio(value: Any) -> float:
    ratio = _finite(value)
    if not ratio > 1.0:
        raise ValueError("it must be > 1 (L2 is sized as a multiple of vLLM's KV cache and "
                         "must be larger than it)")
    return ratio


def _parse_size_gb(value: Any) -> float:
    size_gb = _finite(value)
    if not size_gb >= 0.0:
        raise ValueError("it must be >= 0 GB (0 = use hicache_ratio)")
    return size_gb


def _parse_node_tier_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("expected an integer number of bytes >= 0 (0 = no node tier)")
    return value


def _parse_node_tier_root(value: Any) -> str:
    if not isinstance(value, str) or not os.path.isabs(value) or not value.isprintable():
        raise ValueError("expected an absolute directory path (a tmpfs such as /dev/shm)")
    return value


# Long enough for a digest or a date-stamped name; a key component, not a note.
_MODEL_VERSION_MAX_CHARS = 256


def _parse_model_version(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string naming the weights (empty = fingerprint the "
                         "weight files)")
    if len(value) > _MODEL_VERSION_MAX_CHARS or not value.isprintable():
        raise ValueError(f"expected at most {_MODEL_VERSION_MAX_CHARS} printable characters")
    if value != value.strip():
        # "v2" and "v2 " would silently be two namespaces.
        raise ValueError("leading or trailing whitespace is not allowed")
    return value


def _parse_access_log(value: Any) -> str:
    if not isinstance(value, str) or not value.isprintable():
        raise ValueError("expected a file path (\"\" = off)")
    return value


def _number_in(low: float, high: float) -> Callable[[Any], float]:
    """A number in (low, high], as a float."""
    def parse(value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not low < value <= high):
            raise ValueError(f"expected a number in ({low:g}, {high:g}]")
        return float(value)
    return parse


# --- the configuration ----------------------------------------------------------


@dataclass(frozen=True)
class HiCacheConfig:
    # L2 size as a multiple of vLLM's own KV cache (SGLang --hicache-ratio).
    hicache_ratio: float = option(2.0, parse=_parse_ratio)
    # L2 size in GB (1e9 bytes) per rank; 0 means "use hicache_ratio"
    # (SGLang --hicache-size).
    hicache_size: float = option(0.0, parse=_parse_size_gb)
    # When computed KV is copied L1 -> L2 (SGLang --hicache-write-policy).
    hicache_write_policy: WritePolicyName = option(WritePolicyName.WRITE_THROUGH,
                                                   parse=named(WritePolicyName))
    # Which blocks cross L1 -> L2 and L2 -> L3 (policy/admission.py):
    # "always", "hits:N" (after N requests used the block) or "value:V"
    # (hits x prefix tokens >= V). write_through_selective is L1->L2 "hits:2".
    hicache_l2_admission: AdmissionRule = option(ALWAYS, parse=parse_admission)
    hicache_l3_admission: AdmissionRule = option(ALWAYS, parse=parse_admission)
    # When a block reaches L3: "inclusive" when L2 stores it, "exclusive"
    # when L2 evicts it (l3/victims.py), so L2 + L3 hold more distinct blocks.
    hicache_l3_mode: L3Mode = option(L3Mode.INCLUSIVE, parse=named(L3Mode))
    # Host pool memory layout (SGLang --hicache-mem-layout).
    hicache_mem_layout: MemLayout = option(MemLayout.LAYER_FIRST, parse=named(MemLayout))
    # Copy engine for L1 <-> L2: Triton kernels or torch copies
    # (SGLang --hicache-io-backend).
    hicache_io_backend: IOBackend = option(IOBackend.KERNEL, parse=named(IOBackend))
    # Order in which unpinned L2 leaves are evicted
    # (SGLang --radix-eviction-policy).
    radix_eviction_policy: EvictionPolicyName = option(EvictionPolicyName.LRU,
                                                       parse=named(EvictionPolicyName))
    # layerwise: loads overlap the forward, layer by layer; async: loads run
    # between steps while the request waits in WAITING_FOR_REMOTE_KVS.
    # Hybrid models run async (finish_config).
    hicache_load_mode: LoadMode = option(LoadMode.LAYERWISE, parse=named(LoadMode))
    # Which hits are loaded (policy/load.py): "always" every one; "auto" only
    # those expected to load faster than vLLM would compute them, from the
    # tiers' measured bandwidth and the engine's measured prefill rate (a
    # declined L2 hit is recomputed; a declined L3 hit is not waited for).
    hicache_load_decision: LoadDecision = option(LoadDecision.AUTO, parse=named(LoadDecision))
    # The L3 tier, or None (hicache_storage_* keys, parsed by
    # storage_config.parse_storage; see StorageConfig).
    storage: StorageConfig | None = None
    # Your name for the model's weights, e.g. "llama3-8b-sft-2026-11-30" (no
    # SGLang flag). It goes into every L3 key in place of the fingerprint of
    # the weight files (names, sizes, sampled bytes of *.safetensors, *.bin,
    # *.pt and config.json) computed at start. Change it whenever the weights
    # change without their name, path or revision changing: a checkpoint
    # rewritten in place on a hub, or a LoRA adapter replaced under the same
    # name and path (vLLM's block hashes name an adapter, not its weights).
    # It adds to the model name (path) and revision, never replaces them.
    # Empty: use the fingerprint.
    model_version: str = option("", parse=_parse_model_version)
    # Admin HTTP API (docs/admin-api.md: runtime attach/detach of the L3
    # backend), served by each engine next to the scheduler half. Port 0
    # (the default) = off; under data parallelism engine i listens on port + i.
    admin_api_port: int = option(0, parse=parse_admin_port)
    # Address it binds; anything but loopback needs a key.
    admin_api_host: str = option("127.0.0.1", parse=parse_admin_host)
    # Bearer token every admin call must carry ("Authorization: Bearer <key>"):
    # "auto" = a random one made at each start and written to a file only
    # its owner can read (admin_key_file; admin/key_file.py); the key
    # itself or "@/path/to/file" holding it; "none" = no key (loopback only).
    # Parsed: the key, ADMIN_KEY_AUTO, or "" for none. Never shown.
    admin_api_key: str = option(ADMIN_KEY_AUTO, parse=parse_admin_key, repr=False,
                                shows_files=True)
    # Where admin_api_key="auto" writes admin-api-<port>.key; "" = the
    # default (admin_key_file). Only with admin_api_key="auto".
    admin_api_key_dir: str = option("", parse=parse_key_dir)
    # Directories whose files an admin API attach may name ("@/path" values,
    # tls_*_file options): the resolved real path must lie inside one.
    # Empty = a client can name no file at all.
    admin_api_file_dirs: tuple[str, ...] = option((), parse=parse_file_dirs)
    # Modules an admin API attach of backend "dynamic" may import
    # (module_path, exactly). Empty = "dynamic" is refused over the API.
    admin_api_dynamic_modules: tuple[str, ...] = option((), parse=parse_dynamic_modules)
    # When an admin attach, replace or detach may run: "live" between two
    # steps while requests run, "idle" only when no request runs or waits
    # (SGLang's rule; a different backend then needs a detach first).
    admin_storage_switch: StorageSwitch = option(StorageSwitch.LIVE,
                                                 parse=named(StorageSwitch))
    # Access log for the capacity planner (docs/capacity-planning.md): the
    # file the scheduler half writes, per request, its arrival time, block
    # hash chain (8-byte prefixes), prompt tokens and hit tokens by tier (no
    # text, no token ids). "" = off.
    hicache_access_log: str = option("", parse=_parse_access_log)
    # Fraction of requests logged, in (0, 1]: those whose first block hashes
    # below it, so requests sharing a prefix are logged (or not) together.
    hicache_access_log_sample: float = option(1.0, parse=_number_in(0.0, 1.0))
    # Disk the log may use, in MB (1e6 bytes): it rotates into "<log>.1"
    # (replacing the previous one) at half of it. Finite: the log never
    # grows without bound.
    hicache_access_log_max_mb: float = option(1024.0, parse=_number_in(0.0, 1e9))
    # The decode role of a prefill/decode-disaggregated deployment (docs/pd.md; SGLang
    # --disaggregation-decode-enable-offload-kvcache). HiCache then never
    # looks up or loads anything (NixlConnector delivers the prompt's KV):
    # the full blocks of every request, the prompt received from prefill and
    # the generated tokens, are written through L2 (a staging buffer, never
    # read) to L3 in the background, where the next turn's prefill, on any
    # prefill instance, finds them. Needs an L3 backend, kv_role
    # "kv_consumer" and hicache_write_policy "write_through".
    hicache_decode_offload: bool = option(False, parse=flag)
    # The L3 circuit breaker (l3/breaker.py, docs/l3-backends.md): a store
    # that fails its health checks (errors, or slower than the latency
    # budget) for l3_breaker_window_s is not used (served from L1/L2) until
    # a probe, every l3_breaker_probe_interval_s, finds it healthy again.
    # Applies to the backend configured at start and to one attached later.
    # false = off: the store is always used, whatever it answers.
    l3_breaker: bool = option(True, parse=flag)
    l3_breaker_window_s: float = option(10.0, parse=number(0.0, 86400.0))
    l3_breaker_latency_budget_ms: float = option(1000.0, parse=number(0.0, 3.6e6,
                                                                      low_open=True))
    l3_breaker_probe_interval_s: float = option(1.0, parse=number(0.0, 3600.0, low_open=True))
    # The node tier (docs/node-tier.md): host memory shared by every instance
    # on the machine, in front of any L3 backend. Its size in bytes for the
    # whole machine (every instance sharing it configures the same size);
    # 0 = off.
    node_tier_bytes: int = option(0, parse=_parse_node_tier_bytes)
    # Instances with the same name (and the same model, dtype, layout,
    # parallel shape and storage secret) share one tier.
    node_tier_name: str = option("default", parse=check_node_tier_name)
    # The tmpfs directory the tier lives in.
    node_tier_root: str = option(NODE_TIER_ROOT, parse=_parse_node_tier_root)
    # The keys the user set (not a key): finish_config tells a value chosen
    # from a default it may change.
    keys_given: frozenset[str] = dataclasses.field(default=frozenset(), repr=False,
                                                   compare=False)

    def l2_admission(self, policy: str | None = None) -> AdmissionRule:
        """The L1 -> L2 rule in force under ``policy`` (default: the
        configured write policy); raises ValueError for a contradiction."""
        asked = self.hicache_l2_admission if "hicache_l2_admission" in self.keys_given else None
        return l2_admission_rule(policy or self.hicache_write_policy, asked)

    @property
    def host_bytes_override(self) -> int:
        """L2 bytes per rank requested by hicache_size, or 0 when unset."""
        return int(self.hicache_size * _GB)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> HiCacheConfig:
        """Parse and validate ``kv_connector_extra_config``, rewriting nothing
        (``finish_config`` does, for the engine)."""
        extra = dict(extra or {})
        raw_storage = {k: extra.pop(k) for k in STORAGE_KEYS if k in extra}
        fields = _OPTION_FIELDS
        reject_unknown("kv_connector_extra_config", extra, set(fields) | set(STORAGE_KEYS))
        values = {name: parse_value("", fields[name], value) for name, value in extra.items()}
        _check_node_tier(values)
        # A node tier alone runs on the L3 machinery (storage/node_chain.py).
        storage = parse_storage(raw_storage,
                                NODE_ONLY_BACKEND if values.get("node_tier_bytes") else None)
        cfg = cls(**values, storage=storage, keys_given=frozenset(extra) | frozenset(raw_storage))
        _check_admin_bind(cfg)
        _check_decode_offload(cfg)
        _check_admission(cfg)
        _check_breaker(cfg)
        return cfg

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HiCacheConfig:
        """``parse``, then the platform-independent rewrites, each logged
        (``resolve_conflicts``); for tools and tests. The connector uses
        ``parse`` and ``finish_config``."""
        return resolve_conflicts(cls.parse(extra))


def _check_breaker(cfg: HiCacheConfig) -> None:
    """The breaker's settings mean nothing with the breaker off."""
    tuned = sorted(k for k in cfg.keys_given if k.startswith("l3_breaker_"))
    if not cfg.l3_breaker and tuned:
        raise ValueError(f"{', '.join(tuned)}: set, but l3_breaker is false (the L3 circuit "
                         "breaker is off); drop them or turn it on")


def _check_node_tier(values: Mapping[str, Any]) -> None:
    if values.get("node_tier_bytes"):
        return
    stray = sorted(k for k in ("node_tier_name", "node_tier_root") if k in values)
    if stray:
        raise ValueError(f"{', '.join(stray)} given without node_tier_bytes (the node tier's "
                         "size for the machine, > 0); set it or remove them")


# The user's keys: HiCacheConfig's fields declared with option().
_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(HiCacheConfig) if "parse" in f.metadata}


# --- checks across keys (parse) -------------------------------------------------


def _check_admin_bind(cfg: HiCacheConfig) -> None:
    """The admin API can attach, detach and clear L3: off loopback it must
    not be reachable without a key."""
    host = cfg.admin_api_host
    keyless = cfg.admin_api_key == ""
    if cfg.admin_api_port and keyless and not is_loopback(host):
        raise ValueError(
            f"admin_api_host={host!r} is not a loopback address and admin_api_key is "
            f"{ADMIN_KEY_NONE!r}; use admin_api_key={ADMIN_KEY_AUTO!r} (the default), the key "
            "or @/path/to/file, or bind 127.0.0.1"
        )
    if cfg.admin_api_key_dir and cfg.admin_api_key != ADMIN_KEY_AUTO:
        raise ValueError(
            f"admin_api_key_dir is where admin_api_key={ADMIN_KEY_AUTO!r} writes the key it "
            "makes, but admin_api_key is given; remove one of them")
    unused = sorted(k for k in ("admin_api_key_dir", "admin_api_file_dirs",
                                "admin_api_dynamic_modules") if getattr(cfg, k))
    if cfg.admin_storage_switch != StorageSwitch.LIVE:
        unused.append("admin_storage_switch")
    if unused and not cfg.admin_api_port:
        raise ValueError(f"{', '.join(unused)} set but the admin API is off "
                         "(admin_api_port=0); set admin_api_port or remove them")


# Keys that only steer loads, or log hits for the capacity planner: a
# decode-offload instance never loads, so setting one there is a mistake.
_UNUSED_ON_DECODE_KEYS = ("hicache_load_mode", "hicache_load_decision",
                          "hicache_storage_prefetch_policy", "hicache_access_log",
                          "hicache_access_log_sample", "hicache_access_log_max_mb")


def _check_decode_offload(cfg: HiCacheConfig) -> None:
    """hicache_decode_offload hands a turn's KV to the next turn's prefill
    through L3 only, and must get every full block there."""
    if not cfg.hicache_decode_offload:
        return
    if cfg.storage is None:
        raise ValueError(
            "hicache_decode_offload=true needs an L3 backend: set hicache_storage_backend "
            "(and hicache_storage_backend_extra_config) to the storage the prefill "
            "instances read; a decode instance passes its KV on only through L3")
    policy = cfg.hicache_write_policy
    if policy != WritePolicyName.WRITE_THROUGH:
        raise ValueError(
            f"hicache_decode_offload=true needs hicache_write_policy='write_through' "
            f"(got {policy.value!r}): every full block must reach L3 before the next turn, "
            "not after a second hit or an eviction from L1")
    unused = sorted(cfg.keys_given & set(_UNUSED_ON_DECODE_KEYS))
    if unused:
        raise ValueError(
            f"{', '.join(unused)} set with hicache_decode_offload=true: a decode-offload "
            "instance never loads (NixlConnector delivers the prompt's KV) and has no hits "
            "to log, so these keys would do nothing; remove them")


_L3_TIERING_KEYS = ("hicache_l3_admission", "hicache_l3_mode")


def _check_admission(cfg: HiCacheConfig) -> None:
    """The boundaries' rules agree with the write policy, and L3's rules
    have an L3 to act on (one configured, or attachable over the admin API)."""
    cfg.l2_admission()
    given = sorted(cfg.keys_given & set(_L3_TIERING_KEYS))
    if given and cfg.storage is None and cfg.admin_api_port == 0:
        raise ValueError(
            f"{', '.join(given)} set without an L3 backend: set hicache_storage_backend "
            "(or admin_api_port, to attach one at run time), or remove them")
    if cfg.hicache_decode_offload and (cfg.hicache_l3_mode != L3Mode.INCLUSIVE
                                       or cfg.hicache_l3_admission != ALWAYS):
        raise ValueError(
            "hicache_decode_offload=true writes every full block to L3 for the next turn: "
            "it needs hicache_l3_mode=inclusive and hicache_l3_admission=always (got "
            f"{cfg.hicache_l3_mode.value}, {cfg.hicache_l3_admission})")


# --- the copy backend and host layout (config_finish.py finishes the rest) -------


@dataclass(frozen=True)
class Rewrite:
    """One value ``config_finish.finish_config`` (or ``resolve_conflicts``)
    changed, and why."""

    key: str
    old: str
    new: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}={self.old} -> {self.new}: {self.reason}"


def resolve_conflicts(cfg: HiCacheConfig, kernel_io_missing: str = "") -> HiCacheConfig:
    """The copy backend and host layout ``finish_config`` would choose,
    logging one warning per rewrite: for a fact one process learns alone
    (a worker whose host pool could not be pinned) and for tools."""
    cfg, rewrites = resolve_pair(cfg, kernel_io_missing)
    for rewrite in rewrites:
        logger.warning("HiCache: %s", rewrite)
    return cfg


def resolve_pair(cfg: HiCacheConfig,
                 kernel_io_missing: str) -> tuple[HiCacheConfig, list[Rewrite]]:
    """The one place that decides the copy backend and the host layout.

    ``kernel_io_missing`` names what this platform lacks for the kernel
    backend; then ``kernel`` I/O becomes ``direct``, and the layout follows.
    """
    io_backend, layout = cfg.hicache_io_backend, cfg.hicache_mem_layout
    rewrites: list[Rewrite] = []
    if io_backend == IOBackend.KERNEL and kernel_io_missing:
        rewrites.append(Rewrite("hicache_io_backend", io_backend, IOBackend.DIRECT,
                                f"the kernel backend needs {kernel_io_missing}; falling back "
                                "to direct (torch copies)"))
        io_backend = IOBackend.DIRECT
    if layout == MemLayout.PAGE_FIRST_DIRECT and io_backend == IOBackend.KERNEL:
        rewrites.append(Rewrite("hicache_io_backend", io_backend, IOBackend.DIRECT,
                                "hicache_mem_layout=page_first_direct needs "
                                "hicache_io_backend=direct"))
        io_backend = IOBackend.DIRECT
    if layout == MemLayout.PAGE_FIRST and io_backend == IOBackend.DIRECT:
        rewrites.append(Rewrite("hicache_mem_layout", layout, MemLayout.PAGE_FIRST_DIRECT,
                                "page_first with hicache_io_backend=direct becomes "
                                "page_first_direct (direct copies need page-contiguous runs)"))
        layout = MemLayout.PAGE_FIRST_DIRECT
    resolved = dataclasses.replace(cfg, hicache_io_backend=io_backend, hicache_mem_layout=layout)
    return resolved, rewrites


