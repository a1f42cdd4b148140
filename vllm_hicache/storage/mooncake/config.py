"""Options of the ``mooncake`` L3 backend, parsed once into a frozen dataclass.

The deployment this backend is built for: a ``mooncake_master`` (the object
index) and one or more long-lived ``mooncake_client`` storage daemons (the
memory that holds the objects). vLLM processes are pure clients
(``global_segment_size=0``): objects outlive any vLLM process, and a vLLM
restart loses nothing. A process that contributes a segment (> 0) takes its
objects with it when it exits.

Sizes are bytes: an int, or a string with a unit (``"64MB"``, ``"4 GiB"``;
K/M/G/T are powers of 1024, as in Mooncake's own flags). The shared-memory
("dummy", ``client_server_address``) mode is not offered: its zero copy needs
buffers allocated by Mooncake (alloc_from_mem_pool), and the host pool is
allocated by vllm_hicache.

Mooncake's engine cannot be confined to one interface: its listeners bind
all of them whatever ``local_hostname`` says (master.py logs them at start;
docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hicache.storage.options import Options, choice, integer, number, option, size, text

# A failing start must raise within 30 s; the port wait is the only unbounded
# part we control (see master.connect).
_MAX_CONNECT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class MooncakeConfig(Options):
    owner = "mooncake backend"

    # The master's RPC address, "host:port" ("[v6]:port" for IPv6).
    master_server_address: str = option(
        parse=text(), hint="the mooncake_master RPC address, e.g. '127.0.0.1:50051'")
    # This client's address as other participants reach it (what it
    # advertises; Mooncake still listens on every interface).
    local_hostname: str = option("127.0.0.1", parse=text(empty=False))
    # Transfer-engine metadata: "P2PHANDSHAKE" (no metadata server) or an
    # http://.../metadata or etcd URL; every participant must use the same.
    metadata_server: str = option("P2PHANDSHAKE", parse=text(empty=False))
    # Data transport to the storage daemons.
    protocol: str = option("tcp", parse=choice("tcp", "rdma"))
    # RDMA devices (e.g. "mlx5_0,mlx5_1"); "" lets Mooncake choose / for tcp.
    device_name: str = option("", parse=text())
    # Memory this process lends to the cluster. 0 = pure client (recommended:
    # the storage daemons, mooncake_client, hold the data).
    global_segment_size: int = option(0, parse=size(0, 1 << 50))
    # Mooncake's own transfer buffer (used by its bytes API, not by ours:
    # our I/O goes through registered memory), allocated at setup.
    local_buffer_size: int = option(16 << 20, parse=size(0, 1 << 40))
    # How long construction waits for the master's port before raising
    # ConnectionError.
    connect_timeout_s: float = option(
        5.0, parse=number(0.0, _MAX_CONNECT_TIMEOUT_S, low_open=True))
    # Objects (pages) the registered staging area holds: the only memory of
    # this process that Mooncake's transfer engine can reach (memory.py). A
    # batch larger than the free slots is cut into several calls, and each
    # call costs: 128 pages is one whole L3 batch (l3_worker.BATCH_PAGES).
    staging_pages: int = option(128, parse=integer(1, 4096))
    # After a call fails with RPC_FAIL (master unreachable), calls return
    # misses at once for this long; then one call probes the master again.
    outage_backoff_s: float = option(2.0, parse=number(0.0, 600.0))

    def __post_init__(self) -> None:
        split_address(self.master_server_address)


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
