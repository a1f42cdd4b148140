"""The redis backend's cluster options: parsing, the checks across options, node URLs.

With ``cluster: true`` the ``url`` names one seed node of a Redis Cluster (or
Valkey cluster) and ``cluster_nodes`` optionally more (``"host:port"``). Every
node, seed or discovered, is reached with the url's scheme (``redis://`` or
``rediss://`` with the same TLS files), its user name and the ``password``
option: the url's host and port are the only part that changes per node.

Refused, each with an error naming the option: ``cluster_nodes`` without
``cluster: true``; in cluster mode a ``unix://`` url (cluster nodes announce
TCP endpoints), a database other than 0 (a cluster has only database 0) and
a ``key_prefix`` holding ``{`` or ``}`` (a hash tag there would put every
object in one slot, on one node).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from vllm_hicache.storage.redis.slots import Address


def host_ports(value: Any) -> tuple[str, ...]:
    """A list of ``"host:port"`` strings (IPv6 hosts in brackets), as a tuple."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError('expected a list of "host:port" strings')
    for item in value:
        parse_host_port(item)
    return tuple(value)


def parse_host_port(item: str) -> Address:
    """``"host:port"`` (``"[::1]:7000"``) as (host, port); ValueError naming it."""
    parts = urlsplit(f"//{item}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.username is not None or parts.path:
        raise ValueError(f'{item!r} is not "host:port" (a port in [0, 65535])')
    return parts.hostname, port


def check_cluster_options(url: str, cluster: bool, cluster_nodes: Sequence[str],
                          key_prefix: str, db: int) -> None:
    """The cross-option checks of the module docstring; ValueError naming the
    option (never the url's secrets: the url has none, RedisConfig checked)."""
    if not cluster:
        if cluster_nodes:
            raise ValueError("redis backend option cluster_nodes needs cluster: true")
        return
    if urlsplit(url).scheme not in ("redis", "rediss"):
        raise ValueError("redis backend option cluster: true needs a redis:// or rediss:// "
                         "url (cluster nodes are reached over TCP, not a unix socket)")
    if db != 0:
        raise ValueError(f"redis backend option cluster: true needs database 0 in the url "
                         f"(a Redis Cluster has only database 0), got {db}")
    if "{" in key_prefix or "}" in key_prefix:
        raise ValueError(f"redis backend option key_prefix={key_prefix!r} holds a brace: in a "
                         "cluster a hash tag would put every object on one node")


def seed_addresses(url: str, cluster_nodes: Sequence[str]) -> list[Address]:
    """The url's node first, then ``cluster_nodes``, duplicates dropped."""
    parts = urlsplit(url)
    first = (parts.hostname or "127.0.0.1", parts.port or 6379)
    return list(dict.fromkeys([first, *(parse_host_port(n) for n in cluster_nodes)]))


def node_url(url: str, address: Address) -> str:
    """``url`` with its host and port replaced by ``address`` (database 0)."""
    parts = urlsplit(url)
    host, port = address
    shown_host = f"[{host}]" if ":" in host else host
    user = f"{parts.username}@" if parts.username else ""
    return f"{parts.scheme}://{user}{shown_host}:{port}/0"


def show(address: Address) -> str:
    """An address for logs and errors."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
