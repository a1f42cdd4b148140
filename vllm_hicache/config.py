"""HiCache configuration, parsed once from ``kv_connector_extra_config``.

Invariant: every key a user can set is read here and nowhere else. Unknown keys,
wrong types and out-of-range values raise ``ValueError`` naming the key, the
value and what is accepted. Keys mirror SGLang's ``--hicache-*`` flags.
Incompatible combinations are rewritten with one warning, as SGLang does.
Pure module: imports neither torch nor vllm.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hicache.host.layout_names import MEM_LAYOUTS
from vllm_hicache.kernels.io_backends import IO_BACKENDS
from vllm_hicache.policy.eviction import EVICTION_POLICIES
from vllm_hicache.policy.load import LOAD_DECISIONS
from vllm_hicache.policy.write import WRITE_POLICIES
from vllm_hicache.storage.options import read_option_file
from vllm_hicache.storage_config import STORAGE_KEYS, StorageConfig, parse_storage

logger = logging.getLogger(__name__)

LOAD_MODES = ("layerwise", "async")

_GB = 1e9
# admin_api_key values: a key made at start, and no key at all.
ADMIN_KEY_AUTO = "auto"
ADMIN_KEY_NONE = "none"


@dataclass(frozen=True)
class HiCacheConfig:
    # L2 size as a multiple of vLLM's own KV cache (SGLang --hicache-ratio).
    hicache_ratio: float = 2.0
    # L2 size in GB (1e9 bytes) per rank; 0 means "use hicache_ratio"
    # (SGLang --hicache-size).
    hicache_size: float = 0.0
    # When computed KV is copied L1 -> L2 (SGLang --hicache-write-policy).
    hicache_write_policy: str = "write_through"
    # Host pool memory layout (SGLang --hicache-mem-layout).
    hicache_mem_layout: str = "layer_first"
    # Copy engine for L1 <-> L2: Triton kernels or torch copies
    # (SGLang --hicache-io-backend).
    hicache_io_backend: str = "kernel"
    # Order in which unpinned L2 leaves are evicted
    # (SGLang --radix-eviction-policy).
    radix_eviction_policy: str = "lru"
    # layerwise: loads overlap the forward, layer by layer; async: loads run
    # between steps while the request waits in WAITING_FOR_REMOTE_KVS.
    hicache_load_mode: str = "layerwise"
    # Which hits are loaded (policy/load.py): "always" every one; "auto" only
    # those expected to load faster than vLLM would compute them, from the
    # tiers' measured bandwidth and the engine's measured prefill rate (a
    # declined L2 hit is recomputed; a declined L3 hit is not waited for).
    hicache_load_decision: str = "auto"
    # The L3 tier, or None (hicache_storage_* keys; see StorageConfig).
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
    model_version: str = ""
    # Admin HTTP API (docs/admin-api.md: runtime attach/detach of the L3
    # backend), served by each engine next to the scheduler half. Port 0
    # (the default) = off; under data parallelism engine i listens on port + i.
    admin_api_port: int = 0
    # Address it binds; anything but loopback needs a key.
    admin_api_host: str = "127.0.0.1"
    # Bearer token every admin call must carry ("Authorization: Bearer <key>"):
    # "auto" = a random one made at each start and written to a file only
    # its owner can read (admin_key_file; admin_key.py); the key
    # itself or "@/path/to/file" holding it; "none" = no key (loopback only).
    # Parsed: the key, ADMIN_KEY_AUTO, or "" for none. Never shown.
    admin_api_key: str = dataclasses.field(default=ADMIN_KEY_AUTO, repr=False)
    # Where admin_api_key="auto" writes admin-api-<port>.key; "" = the
    # default (admin_key_file). Only with admin_api_key="auto".
    admin_api_key_dir: str = ""
    # Directories whose files an admin API attach may name ("@/path" values,
    # tls_*_file options): the resolved real path must lie inside one.
    # Empty = a client can name no file at all.
    admin_api_file_dirs: tuple[str, ...] = ()
    # Modules an admin API attach of backend "dynamic" may import
    # (module_path, exactly). Empty = "dynamic" is refused over the API.
    admin_api_dynamic_modules: tuple[str, ...] = ()
    # Access log for the capacity planner (docs/capacity-planning.md): the
    # file the scheduler half writes, per request, its arrival time, block
    # hash chain (8-byte prefixes), prompt tokens and hit tokens by tier (no
    # text, no token ids). "" = off.
    hicache_access_log: str = ""
    # Fraction of requests logged, in (0, 1]: those whose first block hashes
    # below it, so requests sharing a prefix are logged (or not) together.
    hicache_access_log_sample: float = 1.0
    # Disk the log may use, in MB (1e6 bytes): it rotates into "<log>.1"
    # (replacing the previous one) at half of it.
    hicache_access_log_max_mb: float = 1024.0
    # The decode role of a prefill/decode-disaggregated deployment (docs/pd.md; SGLang
    # --disaggregation-decode-enable-offload-kvcache). HiCache then never
    # looks up or loads anything (NixlConnector delivers the prompt's KV):
    # the full blocks of every request, the prompt received from prefill and
    # the generated tokens, are written through L2 (a staging buffer, never
    # read) to L3 in the background, where the next turn's prefill, on any
    # prefill instance, finds them. Needs an L3 backend, kv_role
    # "kv_consumer" and hicache_write_policy "write_through".
    hicache_decode_offload: bool = False

    @property
    def host_bytes_override(self) -> int:
        """L2 bytes per rank requested by hicache_size, or 0 when unset."""
        return int(self.hicache_size * _GB)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HiCacheConfig:
        """Parse and validate ``kv_connector_extra_config``; the only entry point."""
        extra = dict(extra or {})
        raw_storage_keys = [k for k in STORAGE_KEYS if k in extra]
        storage = parse_storage({k: extra.pop(k) for k in raw_storage_keys})
        known = {f.name for f in dataclasses.fields(cls)} - {"storage"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) {unknown}; "
                f"accepted: {sorted(known | set(STORAGE_KEYS))}"
            )
        values = {name: _parse_field(name, value) for name, value in extra.items()}
        _check_admin_bind(values)
        _check_decode_offload(values, storage, given=set(extra) | set(raw_storage_keys))
        return resolve_conflicts(cls(**values, storage=storage))


def _parse_field(name: str, value: Any) -> Any:
    if name in ("hicache_ratio", "hicache_size"):
        return _parse_number(name, value)
    if name == "hicache_decode_offload":
        if not isinstance(value, bool):
            raise ValueError(f"invalid hicache_decode_offload={value!r}; expected true or false")
        return value
    if name == "model_version":
        return _parse_model_version(value)
    if name in _ADMIN_PARSERS:
        return _ADMIN_PARSERS[name](value)
    if name in _ACCESS_LOG_PARSERS:
        return _ACCESS_LOG_PARSERS[name](value)
    choices = {
        "hicache_write_policy": WRITE_POLICIES,
        "hicache_mem_layout": MEM_LAYOUTS,
        "hicache_io_backend": IO_BACKENDS,
        "radix_eviction_policy": EVICTION_POLICIES,
        "hicache_load_mode": LOAD_MODES,
        "hicache_load_decision": LOAD_DECISIONS,
    }[name]
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"invalid {name}={value!r}; accepted: {', '.join(choices)}"
        )
    return value


# Long enough for a digest or a date-stamped name; a key component, not a note.
_MODEL_VERSION_MAX_CHARS = 256


def _parse_model_version(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(
            f"invalid model_version={value!r}; expected a string naming the weights "
            "(empty = fingerprint the weight files)"
        )
    if len(value) > _MODEL_VERSION_MAX_CHARS or not value.isprintable():
        raise ValueError(
            f"invalid model_version={value!r}; expected at most "
            f"{_MODEL_VERSION_MAX_CHARS} printable characters"
        )
    if value != value.strip():
        # "v2" and "v2 " would silently be two namespaces.
        raise ValueError(
            f"invalid model_version={value!r}; leading or trailing whitespace is not allowed"
        )
    return value


def _parse_admin_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(
            f"invalid admin_api_port={value!r}; expected an integer in [0, 65535] (0 = off)"
        )
    return value


def _parse_admin_host(value: Any) -> str:
    if not isinstance(value, str) or not value or not value.isprintable() or " " in value:
        raise ValueError(
            f"invalid admin_api_host={value!r}; expected an address to bind, e.g. 127.0.0.1"
        )
    return value


# A token shorter than this is refused: it would be guessable.
_ADMIN_KEY_MIN_CHARS = 16


def _parse_admin_key(value: Any) -> str:
    """The key itself, ADMIN_KEY_AUTO, or "" for "none"; ``@path`` reads the
    key from a file (stripped). Errors name the file, never the key."""
    accepted = (f"expected {ADMIN_KEY_AUTO!r}, {ADMIN_KEY_NONE!r}, the key or "
                "@/path/to/file holding it")
    if not isinstance(value, str) or not value:
        raise ValueError(f"invalid admin_api_key; {accepted}")
    if value == ADMIN_KEY_AUTO:
        return value
    if value == ADMIN_KEY_NONE:
        return ""
    if value.startswith("@"):
        try:
            key = read_option_file(value[1:]).decode("utf-8").strip()
        except UnicodeError:
            raise ValueError(f"invalid admin_api_key={value!r}: not UTF-8 text") from None
        except ValueError as err:
            raise ValueError(f"invalid admin_api_key={value!r}: {err}") from None
        where = f"in {value[1:]!r}"
    else:
        key, where = value, "given"
    if len(key) < _ADMIN_KEY_MIN_CHARS or not key.isprintable() or " " in key:
        raise ValueError(
            f"invalid admin_api_key {where}; expected at least {_ADMIN_KEY_MIN_CHARS} "
            "printable characters without spaces"
        )
    return key


def _parse_absolute_dir(name: str, value: Any) -> str:
    path = os.path.expanduser(value) if isinstance(value, str) else ""
    if not os.path.isabs(path) or not path.isprintable():
        raise ValueError(f"invalid {name} entry {value!r}; expected an absolute directory path")
    return os.path.normpath(path)


def _parse_key_dir(value: Any) -> str:
    return "" if value == "" else _parse_absolute_dir("admin_api_key_dir", value)


def _parse_file_dirs(value: Any) -> tuple[str, ...]:
    """Real paths (symbolic links resolved), as the files named are checked."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"invalid admin_api_file_dirs={value!r}; expected a list of absolute "
                         "directory paths, e.g. [\"/etc/hicache\"]")
    dirs = tuple(os.path.realpath(_parse_absolute_dir("admin_api_file_dirs", v)) for v in value)
    if os.sep in dirs:
        raise ValueError("invalid admin_api_file_dirs: '/' would let a client name any file; "
                         "list the directories holding the secrets to allow")
    return dirs


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _parse_dynamic_modules(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and _MODULE_NAME.match(v) for v in value):
        raise ValueError(f"invalid admin_api_dynamic_modules={value!r}; expected a list of "
                         "module names, e.g. [\"my_pkg.my_backend\"]")
    return tuple(value)


_ADMIN_PARSERS: dict[str, Callable[[Any], object]] = {
    "admin_api_port": _parse_admin_port,
    "admin_api_host": _parse_admin_host,
    "admin_api_key": _parse_admin_key,
    "admin_api_key_dir": _parse_key_dir,
    "admin_api_file_dirs": _parse_file_dirs,
    "admin_api_dynamic_modules": _parse_dynamic_modules,
}


def admin_key_file(key_dir: str, port: int) -> Path:
    """Where admin_api_key="auto" writes the key of the admin API on
    ``port``: ``key_dir``, else $XDG_RUNTIME_DIR/vllm_hicache (a per-user
    tmpfs), else ~/.cache/vllm_hicache."""
    if not key_dir:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        key_dir = (os.path.join(runtime, "vllm_hicache") if os.path.isabs(runtime)
                   else os.path.expanduser("~/.cache/vllm_hicache"))
    return Path(key_dir) / f"admin-api-{port}.key"


def _parse_access_log(value: Any) -> str:
    if not isinstance(value, str) or not value.isprintable():
        raise ValueError(f"invalid hicache_access_log={value!r}; expected a file path "
                         "(\"\" = off)")
    return value


def _parse_access_log_number(name: str, lo: float, hi: float, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value <= hi:
        raise ValueError(f"invalid {name}={value!r}; expected a number in ({lo:g}, {hi:g}]")
    return float(value)


_ACCESS_LOG_PARSERS: dict[str, Callable[[Any], object]] = {
    "hicache_access_log": _parse_access_log,
    "hicache_access_log_sample": lambda v: _parse_access_log_number(
        "hicache_access_log_sample", 0.0, 1.0, v),
    "hicache_access_log_max_mb": lambda v: _parse_access_log_number(
        "hicache_access_log_max_mb", 0.0, 1e9, v),  # finite: the log never grows unbounded
}


def is_loopback(host: str) -> bool:
    """Does ``host`` (an admin_api_host) name a loopback address?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_admin_bind(values: Mapping[str, Any]) -> None:
    """The admin API can attach, detach and clear L3: off loopback it must
    not be reachable without a key."""
    host = values.get("admin_api_host", "127.0.0.1")
    keyless = values.get("admin_api_key", ADMIN_KEY_AUTO) == ""
    if values.get("admin_api_port", 0) and keyless and not is_loopback(host):
        raise ValueError(
            f"admin_api_host={host!r} is not a loopback address and admin_api_key is "
            f"{ADMIN_KEY_NONE!r}; use admin_api_key={ADMIN_KEY_AUTO!r} (the default), the key "
            "or @/path/to/file, or bind 127.0.0.1"
        )
    if values.get("admin_api_key_dir") and values.get("admin_api_key",
                                                      ADMIN_KEY_AUTO) != ADMIN_KEY_AUTO:
        raise ValueError(
            f"admin_api_key_dir is where admin_api_key={ADMIN_KEY_AUTO!r} writes the key it "
            "makes, but admin_api_key is given; remove one of them")
    unused = sorted(k for k in ("admin_api_key_dir", "admin_api_file_dirs",
                                "admin_api_dynamic_modules") if values.get(k))
    if unused and not values.get("admin_api_port", 0):
        raise ValueError(f"{', '.join(unused)} set but the admin API is off "
                         "(admin_api_port=0); set admin_api_port or remove them")


# Keys that only steer loads, or log hits for the capacity planner: a
# decode-offload instance never loads, so setting one there is a mistake.
_UNUSED_ON_DECODE_KEYS = ("hicache_load_mode", "hicache_load_decision",
                   "hicache_storage_prefetch_policy", "hicache_access_log",
                   "hicache_access_log_sample", "hicache_access_log_max_mb")


def _check_decode_offload(values: Mapping[str, Any], storage: StorageConfig | None,
                          given: set[str]) -> None:
    """hicache_decode_offload hands a turn's KV to the next turn's prefill
    through L3 only, and must get every full block there."""
    if not values.get("hicache_decode_offload"):
        return
    if storage is None:
        raise ValueError(
            "hicache_decode_offload=true needs an L3 backend: set hicache_storage_backend "
            "(and hicache_storage_backend_extra_config) to the storage the prefill "
            "instances read; a decode instance passes its KV on only through L3")
    policy = values.get("hicache_write_policy", "write_through")
    if policy != "write_through":
        raise ValueError(
            f"hicache_decode_offload=true needs hicache_write_policy='write_through' "
            f"(got {policy!r}): every full block must reach L3 before the next turn, "
            "not after a second hit or an eviction from L1")
    unused = sorted(given & set(_UNUSED_ON_DECODE_KEYS))
    if unused:
        raise ValueError(
            f"{', '.join(unused)} set with hicache_decode_offload=true: a decode-offload "
            "instance never loads (NixlConnector delivers the prompt's KV) and has no hits "
            "to log, so these keys would do nothing; remove them")


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


def _parse_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"invalid {name}={value!r}; expected a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"invalid {name}={value!r}; expected a number") from None
    if name == "hicache_ratio" and not number > 1.0:
        raise ValueError(
            f"invalid hicache_ratio={value!r}; it must be > 1 (L2 is sized as a "
            "multiple of vLLM's KV cache and must be larger than it)"
        )
    if name == "hicache_size" and not number >= 0.0:
        raise ValueError(
            f"invalid hicache_size={value!r}; it must be >= 0 GB (0 = use hicache_ratio)"
        )
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"invalid {name}={value!r}; expected a finite number")
    return number


def resolve_conflicts(cfg: HiCacheConfig, kernel_io_missing: str = "") -> HiCacheConfig:
    """The one place that decides the copy backend and the host layout.

    Rewrites incompatible layout / I/O pairs, warning once per rewrite.
    ``kernel_io_missing`` names what this platform lacks for the kernel
    backend ('' when nothing; ``kernels.factory.kernel_io_missing`` finds out);
    then ``kernel`` I/O becomes ``direct``, and the layout follows. The
    connector calls this once per process and hands the result to its half.
    """
    io_backend, layout = cfg.hicache_io_backend, cfg.hicache_mem_layout
    if io_backend == "kernel" and kernel_io_missing:
        logger.warning(
            "hicache_io_backend=kernel needs %s; falling back to direct (torch copies)",
            kernel_io_missing,
        )
        io_backend = "direct"
    if layout == "page_first_direct" and io_backend == "kernel":
        logger.warning(
            "hicache_mem_layout=page_first_direct needs hicache_io_backend=direct; "
            "switching the I/O backend to direct"
        )
        io_backend = "direct"
    if layout == "page_first" and io_backend == "direct":
        logger.warning(
            "hicache_mem_layout=page_first with hicache_io_backend=direct becomes "
            "page_first_direct (direct copies need page-contiguous runs)"
        )
        layout = "page_first_direct"
    return dataclasses.replace(
        cfg, hicache_io_backend=io_backend, hicache_mem_layout=layout
    )
