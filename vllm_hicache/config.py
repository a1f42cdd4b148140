"""HiCache configuration, parsed once from ``kv_connector_extra_config``.

Invariant: every key a user can set is read here and nowhere else, and every
decision about the configuration is taken here. Each key is a field of
``HiCacheConfig`` declared with ``option(default, parse=...)``
(storage/options.py, as the storage backends' options): its default, its
parser and its error live on the field. Unknown keys, wrong types and
out-of-range values raise ``ValueError`` naming the key, the value and what is
accepted. Keys mirror SGLang's ``--hicache-*`` flags; values with a fixed set
of names are str-valued enums owned by the floor that acts on them
(``host/``: layouts, ``kernels/``: copy backends, ``policy/``: policies).

Two steps, both pure:

- ``HiCacheConfig.parse`` checks keys, values and the combinations that do
  not depend on the engine (admin API binding, decode offload).
- ``finish_config`` takes the facts the connector extracts from vLLM and the
  platform (``EngineFacts``) and returns the configuration the engine runs
  with, plus the ``Rewrite`` s it made: incompatible layout / copy backend
  pairs, the copy backend this platform lacks, a hybrid model's load mode;
  or refuses a contradiction (PD role, hybrid models). It logs nothing: the
  scheduler half logs the rewrites once per engine.

``HiCacheConfig.from_extra_config`` (parse, then the platform-independent
rewrites, each logged) is for tools and tests. Pure module: imports neither
torch nor vllm.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from vllm_hicache.host.layout_names import MEM_LAYOUTS, MemLayout
from vllm_hicache.kernels.io_backends import IO_BACKENDS, IOBackend
from vllm_hicache.option_file import read_option_file
from vllm_hicache.policy.eviction import EVICTION_POLICIES, EvictionPolicyName
from vllm_hicache.policy.load import LoadDecision
from vllm_hicache.policy.write import WritePolicyName
from vllm_hicache.storage.options import (
    flag,
    named,
    option,
    parse_value,
    reject_unknown,
)
from vllm_hicache.storage_config import STORAGE_KEYS, StorageConfig, parse_storage

__all__ = [
    "EVICTION_POLICIES", "IO_BACKENDS", "MEM_LAYOUTS", "EngineFacts", "HiCacheConfig",
    "LoadMode", "Rewrite", "finish_config", "resolve_conflicts",
]

logger = logging.getLogger(__name__)


class LoadMode(StrEnum):
    """hicache_load_mode's values (a str: compares and prints as its name)."""

    LAYERWISE = "layerwise"
    ASYNC = "async"


LOAD_MODES = tuple(LoadMode)

_GB = 1e9
# admin_api_key values: a key made at start, and no key at all.
ADMIN_KEY_AUTO = "auto"
ADMIN_KEY_NONE = "none"


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


def _parse_admin_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError("expected an integer in [0, 65535] (0 = off)")
    return value


def _parse_admin_host(value: Any) -> str:
    if not isinstance(value, str) or not value or not value.isprintable() or " " in value:
        raise ValueError("expected an address to bind, e.g. 127.0.0.1")
    return value


# A token shorter than this is refused: it would be guessable.
_ADMIN_KEY_MIN_CHARS = 16


def _parse_admin_key(value: Any) -> str:
    """The key itself, ADMIN_KEY_AUTO, or "" for "none"; ``@path`` reads the
    key from a file (stripped). Errors name the file, never the key."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected {ADMIN_KEY_AUTO!r}, {ADMIN_KEY_NONE!r}, the key or "
                         "@/path/to/file holding it")
    if value == ADMIN_KEY_AUTO:
        return value
    if value == ADMIN_KEY_NONE:
        return ""
    if value.startswith("@"):
        try:
            key = read_option_file(value[1:]).decode("utf-8").strip()
        except UnicodeError:
            raise ValueError("not UTF-8 text") from None
        where = f"in {value[1:]!r}"
    else:
        key, where = value, "given"
    if len(key) < _ADMIN_KEY_MIN_CHARS or not key.isprintable() or " " in key:
        raise ValueError(f"the key {where} is refused; expected at least "
                         f"{_ADMIN_KEY_MIN_CHARS} printable characters without spaces")
    return key


def _absolute_dir(value: Any) -> str:
    path = os.path.expanduser(value) if isinstance(value, str) else ""
    if not os.path.isabs(path) or not path.isprintable():
        raise ValueError(f"entry {value!r} is not an absolute directory path")
    return os.path.normpath(path)


def _parse_key_dir(value: Any) -> str:
    return "" if value == "" else _absolute_dir(value)


def _parse_file_dirs(value: Any) -> tuple[str, ...]:
    """Real paths (symbolic links resolved), as the files named are checked."""
    if not isinstance(value, (list, tuple)):
        raise ValueError("expected a list of absolute directory paths, e.g. "
                         "[\"/etc/hicache\"]")
    dirs = tuple(os.path.realpath(_absolute_dir(v)) for v in value)
    if os.sep in dirs:
        raise ValueError("'/' would let a client name any file; list the directories "
                         "holding the secrets to allow")
    return dirs


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _parse_dynamic_modules(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and _MODULE_NAME.match(v) for v in value):
        raise ValueError("expected a list of module names, e.g. [\"my_pkg.my_backend\"]")
    return tuple(value)


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
    admin_api_port: int = option(0, parse=_parse_admin_port)
    # Address it binds; anything but loopback needs a key.
    admin_api_host: str = option("127.0.0.1", parse=_parse_admin_host)
    # Bearer token every admin call must carry ("Authorization: Bearer <key>"):
    # "auto" = a random one made at each start and written to a file only
    # its owner can read (admin_key_file; admin/key_file.py); the key
    # itself or "@/path/to/file" holding it; "none" = no key (loopback only).
    # Parsed: the key, ADMIN_KEY_AUTO, or "" for none. Never shown.
    admin_api_key: str = option(ADMIN_KEY_AUTO, parse=_parse_admin_key, repr=False,
                                shows_files=True)
    # Where admin_api_key="auto" writes admin-api-<port>.key; "" = the
    # default (admin_key_file). Only with admin_api_key="auto".
    admin_api_key_dir: str = option("", parse=_parse_key_dir)
    # Directories whose files an admin API attach may name ("@/path" values,
    # tls_*_file options): the resolved real path must lie inside one.
    # Empty = a client can name no file at all.
    admin_api_file_dirs: tuple[str, ...] = option((), parse=_parse_file_dirs)
    # Modules an admin API attach of backend "dynamic" may import
    # (module_path, exactly). Empty = "dynamic" is refused over the API.
    admin_api_dynamic_modules: tuple[str, ...] = option((), parse=_parse_dynamic_modules)
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
    # The keys the user set (not a key): finish_config tells a value chosen
    # from a default it may change.
    keys_given: frozenset[str] = dataclasses.field(default=frozenset(), repr=False,
                                                   compare=False)

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
        storage = parse_storage(raw_storage)
        fields = _OPTION_FIELDS
        reject_unknown("kv_connector_extra_config", extra, set(fields) | set(STORAGE_KEYS))
        values = {name: parse_value("", fields[name], value) for name, value in extra.items()}
        cfg = cls(**values, storage=storage, keys_given=frozenset(extra) | frozenset(raw_storage))
        _check_admin_bind(cfg)
        _check_decode_offload(cfg)
        return cfg

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HiCacheConfig:
        """``parse``, then the platform-independent rewrites, each logged
        (``resolve_conflicts``); for tools and tests. The connector uses
        ``parse`` and ``finish_config``."""
        return resolve_conflicts(cls.parse(extra))


# The user's keys: HiCacheConfig's fields declared with option().
_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(HiCacheConfig) if "parse" in f.metadata}


def admin_key_file(key_dir: str, port: int) -> Path:
    """Where admin_api_key="auto" writes the key of the admin API on
    ``port``: ``key_dir``, else $XDG_RUNTIME_DIR/vllm_hicache (a per-user
    tmpfs), else ~/.cache/vllm_hicache."""
    if not key_dir:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        key_dir = (os.path.join(runtime, "vllm_hicache") if os.path.isabs(runtime)
                   else os.path.expanduser("~/.cache/vllm_hicache"))
    return Path(key_dir) / f"admin-api-{port}.key"


def is_loopback(host: str) -> bool:
    """Does ``host`` (an admin_api_host) name a loopback address?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


# --- finishing: the configuration an engine runs with ---------------------------


@dataclass(frozen=True)
class Rewrite:
    """One value ``finish_config`` (or ``resolve_conflicts``) changed, and why."""

    key: str
    old: str
    new: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}={self.old} -> {self.new}: {self.reason}"


@dataclass(frozen=True)
class EngineFacts:
    """What the engine and the platform say, as plain values (the connector
    extracts them from vLLM, so this module needs none of it)."""

    # What this platform lacks for hicache_io_backend=kernel ("" = nothing;
    # kernels.kernel_io_missing finds out).
    kernel_io_missing: str = ""
    # HiCache's kv_role in vLLM's kv_transfer_config (None = not given).
    kv_role: str | None = None
    # Kinds of vLLM's KV cache groups, in its order, for a hybrid model
    # (geometry.KVGroup.kind); () for one group.
    kv_group_kinds: tuple[str, ...] = ()
    # Does a group hold Mamba / linear-attention state (raw state pages)?
    state_groups: bool = False


def finish_config(cfg: HiCacheConfig,
                  facts: EngineFacts) -> tuple[HiCacheConfig, list[Rewrite]]:
    """The configuration the engine runs with, and the rewrites made to get it.

    Raises ValueError, naming the keys, for a contradiction with the PD role
    (``check_kv_role``) or with a hybrid model's KV cache groups. Every
    process of one engine gets the same facts (the same model, platform and
    kv_role), so both halves, and the L3 keys they derive, agree; the
    scheduler half logs the rewrites, the workers do not repeat them.
    """
    check_kv_role(cfg, facts.kv_role)
    cfg, rewrites = _resolve_pair(cfg, facts.kernel_io_missing)
    cfg, group_rewrites = _fit_to_groups(cfg, facts.kv_group_kinds, facts.state_groups)
    return cfg, rewrites + group_rewrites


def resolve_conflicts(cfg: HiCacheConfig, kernel_io_missing: str = "") -> HiCacheConfig:
    """The copy backend and host layout ``finish_config`` would choose,
    logging one warning per rewrite: for a fact one process learns alone
    (a worker whose host pool could not be pinned) and for tools."""
    cfg, rewrites = _resolve_pair(cfg, kernel_io_missing)
    for rewrite in rewrites:
        logger.warning("HiCache: %s", rewrite)
    return cfg


def _resolve_pair(cfg: HiCacheConfig,
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


def _fit_to_groups(cfg: HiCacheConfig, kinds: tuple[str, ...],
                   state_groups: bool) -> tuple[HiCacheConfig, list[Rewrite]]:
    """The configuration a hybrid model (several KV cache groups) runs with;
    ValueError naming the key of an option that cannot serve them.

    - ``hicache_load_mode``: vLLM takes load failures of a multi-group model
      only per request, and only for async loads (its ``invalid_block_ids``
      path raises there), so loads are async. Left unset, it becomes async;
      set to layerwise, the engine is refused.
    - ``hicache_write_policy=write_back`` copies a block when vLLM reuses it,
      which the pool reports per block of one group: refused.
    - ``tp_lcm_size`` with a Mamba group: head slices of a raw state page
      mean nothing: refused.
    """
    if len(kinds) <= 1:
        return cfg, []
    described = f"{len(kinds)} KV cache groups: {'+'.join(kinds)}"
    if state_groups and cfg.storage is not None and cfg.storage.tp_lcm_size:
        # Head slices cut pages by attention heads; a state page is raw bytes.
        raise ValueError(
            f"tp_lcm_size (in hicache_storage_backend_extra_config) is not supported for "
            f"models with Mamba / linear-attention state ({'+'.join(kinds)}): their state "
            "pages cannot be cut into head slices; leave it unset")
    if cfg.hicache_write_policy == WritePolicyName.WRITE_BACK:
        raise ValueError(
            f"hicache_write_policy=write_back is not supported for hybrid models "
            f"({described}); use write_through or write_through_selective")
    if cfg.hicache_load_mode == LoadMode.ASYNC:
        return cfg, []
    if "hicache_load_mode" in cfg.keys_given:
        raise ValueError(
            f"hicache_load_mode={cfg.hicache_load_mode} is not supported for hybrid "
            f"models ({described}): vLLM can only be told of a failed load per request, "
            "for async loads; set hicache_load_mode=async")
    rewrite = Rewrite("hicache_load_mode", cfg.hicache_load_mode, LoadMode.ASYNC,
                      f"a hybrid model ({described}) reports failed loads per request, "
                      "which vLLM takes for async loads only")
    return dataclasses.replace(cfg, hicache_load_mode=LoadMode.ASYNC), [rewrite]


# vLLM's kv_role values (vllm.config.kv_transfer.KVRole).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def check_kv_role(cfg: HiCacheConfig, kv_role: str | None) -> None:
    """Refuse a HiCache ``kv_role`` that contradicts hicache_decode_offload.

    In a MultiConnector, HiCache's entry carries the instance's PD role, like
    the NixlConnector entry next to it: "kv_producer" on prefill instances
    (HiCache loads hits and stores, as on a single instance), "kv_consumer"
    on decode instances (HiCache only offloads), "kv_both" without PD.
    """
    role = kv_role or "kv_both"
    if role not in KV_ROLES:
        raise ValueError(f"invalid kv_role={kv_role!r} for HiCacheConnector; accepted: "
                         f"{', '.join(KV_ROLES)}")
    if cfg.hicache_decode_offload and role != "kv_consumer":
        raise ValueError(
            f"hicache_decode_offload=true is the decode instance's role, but HiCache's "
            f"kv_role={role!r}: set kv_role='kv_consumer' (as NixlConnector's on decode) or "
            "drop hicache_decode_offload (prefill instances load and store as usual)")
    if role == "kv_consumer" and not cfg.hicache_decode_offload:
        raise ValueError(
            "HiCache's kv_role='kv_consumer' (a decode instance) needs "
            "hicache_decode_offload=true: on decode NixlConnector delivers the prompt's KV "
            "and HiCache may only offload; use kv_role='kv_producer' on prefill instances "
            "or 'kv_both' without PD")

