"""Options of the ``mooncake`` L3 backend, parsed once into a frozen dataclass.

The deployment this backend is built for: a ``mooncake_master`` (the object
index) and one or more long-lived ``mooncake_client`` storage daemons (the
memory that holds the objects). vLLM processes are pure clients
(``global_segment_size=0``): objects outlive any vLLM process, and a vLLM
restart loses nothing. A process that contributes a segment (> 0) takes its
objects with it when it exits.

Sizes are bytes: an int, or a string with a unit (``"64MB"``, ``"4 GiB"``;
K/M/G/T are powers of 1024, as in Mooncake's own flags).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hicache.storage.options import check_range, reject_unknown, require

# A failing start must raise within 30 s; the port wait is the only unbounded
# part we control (see MooncakeBackend._connect).
_MAX_CONNECT_TIMEOUT_S = 20.0
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}
_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeConfig:
    # The master's RPC address, "host:port" ("[v6]:port" for IPv6); required.
    master_server_address: str
    # This client's address as other participants reach it.
    local_hostname: str = "127.0.0.1"
    # Transfer-engine metadata: "P2PHANDSHAKE" (no metadata server) or an
    # http://.../metadata or etcd URL; every participant must use the same.
    metadata_server: str = "P2PHANDSHAKE"
    # Data transport to the storage daemons: "tcp" or "rdma".
    protocol: str = "tcp"
    # RDMA devices (e.g. "mlx5_0,mlx5_1"); "" lets Mooncake choose / for tcp.
    device_name: str = ""
    # Memory this process lends to the cluster. 0 = pure client (recommended:
    # the daemons hold the data).
    global_segment_size: int = 0
    # Mooncake's own transfer buffer (used by its bytes API, not by ours:
    # our I/O goes through registered memory), allocated at setup.
    local_buffer_size: int = 16 << 20
    # How long construction waits for the master's port before raising.
    connect_timeout_s: float = 5.0
    # Capacity of one registered staging buffer: buffers outside registered
    # memory (headers, unregistered payloads) are copied through one. A call
    # in flight holds one; a batch needing more is cut into chunks.
    staging_bytes: int = 16 << 20
    # After a call fails with RPC_FAIL (master unreachable), calls return
    # misses at once for this long; then one call probes the master again.
    outage_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        split_address(self.master_server_address)
        if self.protocol not in _PROTOCOLS:
            raise ValueError(
                f"invalid mooncake backend option protocol={self.protocol!r}: "
                f"accepted {list(_PROTOCOLS)}"
            )
        for name in ("local_hostname", "metadata_server"):
            if not getattr(self, name):
                raise ValueError(f"invalid mooncake backend option {name}: must be non-empty")
        check_range("mooncake", "connect_timeout_s", self.connect_timeout_s, 0.0, _MAX_CONNECT_TIMEOUT_S)
        check_range("mooncake", "outage_backoff_s", self.outage_backoff_s, 0.0, 600.0, with_low=True)
        check_range("mooncake", "global_segment_size", self.global_segment_size, 0, 1 << 50, with_low=True)
        check_range("mooncake", "local_buffer_size", self.local_buffer_size, 0, 1 << 40, with_low=True)
        check_range("mooncake", "staging_bytes", self.staging_bytes, 0, 1 << 34)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MooncakeConfig:
        """Validate ``options`` (names, types, ranges) into a config."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        reject_unknown("mooncake", options, fields)
        require("mooncake", options, "master_server_address", "the mooncake_master RPC address, e.g. '127.0.0.1:50051'")
        values = {name: _coerce(name, fields[name].type, v) for name, v in options.items()}
        return cls(**values)


def split_address(address: Any) -> tuple[str, int]:
    """("host", port) of a "host:port" / "[v6]:port" string, else ValueError."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"invalid mooncake backend option master_server_address={address!r}: "
            "expected 'host:port', e.g. '127.0.0.1:50051'"
        )
    return host, int(port)


def parse_size(name: str, value: Any) -> int:
    """Bytes of an int or a "64MB"-style string, else ValueError naming ``name``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"invalid mooncake backend option {name}={value!r}: expected bytes as an int "
            "or a string such as '64MB' / '4 GiB'"
        )
    return int(match.group(1)) << _UNITS[match.group(2).lower()]


def _coerce(name: str, annotation: str, value: Any) -> Any:
    """One option's value as its field's type (annotations are strings here)."""
    if annotation == "int":
        return parse_size(name, value)
    if annotation == "str" and isinstance(value, str):
        return value
    if annotation == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"invalid mooncake backend option {name}={value!r}: expected {annotation}")


