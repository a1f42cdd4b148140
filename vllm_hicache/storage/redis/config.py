"""Options of the ``redis`` L3 backend, parsed once into a frozen dataclass.

The server is named by one ``url`` (redis-py's URL scheme); every other knob is
its own option, so the URL carries no secret and can be logged as it is:

    redis://HOST[:PORT][/DB]          TCP (default port 6379, db 0)
    rediss://HOST[:PORT][/DB]         TCP + TLS (system CA store)
    unix:///PATH/redis.sock[?db=N]    unix domain socket

A user name may appear in the URL (``redis://alice@host``, Redis 6 ACL); the
password may not: it goes in ``password`` (or ``@/path/to/file`` holding it;
a password that itself starts with "@" must come from a file), which no repr
or error shows. With ``rediss://`` the server's certificate and
host name are verified against ``tls_ca_file`` (default: the system CA
store); ``tls_cert_file`` + ``tls_key_file`` present a client certificate
(servers with ``tls-auth-clients yes``).

With ``cluster: true`` the url names a seed node of a Redis Cluster and
``cluster_nodes`` more seeds; cluster_options.py says which combinations are
refused and how each node's address is made from the url.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redis.connection import parse_url

from vllm_hicache.redaction import REDACTED, redacted
from vllm_hicache.storage.options import (
    Options,
    flag,
    integer,
    number,
    option,
    optional,
    readable_file,
    secret,
    text,
)
from vllm_hicache.storage.redis.cluster_options import check_cluster_options, host_ports

_TLS_OPTIONS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
# URL query arguments we accept; the rest have an option of their own.
_URL_QUERY_KEYS = frozenset({"db"})
# Bounds that keep a failing start under 30 s (see wire.probe_server).
_MAX_CONNECT_TIMEOUT_S = 5.0
_MAX_STARTUP_WAIT_S = 15.0


@dataclass(frozen=True)
class RedisConfig(Options):
    owner = "redis backend"

    # Server address (see the module docstring); no password in it.
    url: str = option(parse=text(), hint="e.g. redis://127.0.0.1:6379/0 or "
                      "unix:///run/redis/redis.sock")
    # AUTH password (``requirepass`` or, with a user name in the URL, the ACL
    # user's), or "@/path/to/file" holding it; never shown.
    password: str | None = option(None, parse=optional(secret), repr=False)
    # Prepended to every object key. clear() deletes the keys matching
    # ``key_prefix*`` and nothing else, so it must be non-empty.
    key_prefix: str = option("hicache:", parse=text(empty=False, printable=True),
                             hint="clear() deletes every key starting with it")
    # Bound on one socket read or write; a call against a hung server fails
    # (as misses) after about this long.
    socket_timeout_s: float = option(2.0, parse=number(0.0, 600.0, low_open=True))
    # Bound on opening one connection.
    connect_timeout_s: float = option(
        2.0, parse=number(0.0, _MAX_CONNECT_TIMEOUT_S, low_open=True))
    # Connections per process (pool size); threads beyond it wait for one,
    # up to socket_timeout_s.
    max_connections: int = option(16, parse=integer(1, 4096))
    # Most commands sent in one pipeline (one round trip).
    batch_size: int = option(128, parse=integer(1, 1 << 20))
    # Most object bytes in one pipeline (a bigger object goes alone). Small
    # chunks keep the server's reply buffers and ours hot in cache: GET of
    # 1 MiB objects ran 2-4x faster with 2-4 MiB chunks than with 64 MiB.
    batch_bytes: int = option(4 << 20, parse=integer(1, 1 << 40))
    # At start, keep retrying an unreachable server for this long (it may be
    # starting alongside vLLM) before raising ConnectionError.
    startup_wait_s: float = option(5.0, parse=number(0.0, _MAX_STARTUP_WAIT_S))
    # rediss:// only: PEM CA bundle that signs the server's certificate
    # (default: the system store), and a client certificate and its key.
    tls_ca_file: str | None = option(None, parse=optional(readable_file))
    tls_cert_file: str | None = option(None, parse=optional(readable_file))
    tls_key_file: str | None = option(None, parse=optional(readable_file))
    # The url names a seed node of a Redis Cluster / Valkey cluster; more seeds
    # ("host:port") in cluster_nodes. Every node is reached with the url's
    # scheme, user, password and TLS files (cluster_options.py, cluster.py).
    cluster: bool = option(False, parse=flag)
    cluster_nodes: tuple[str, ...] = option((), parse=host_ports)

    def __post_init__(self) -> None:
        _check_url(self.url)
        given = [n for n in _TLS_OPTIONS if getattr(self, n) is not None]
        if given and urlsplit(self.url).scheme != "rediss":
            raise ValueError(f"redis backend option(s) {given} need a rediss:// url (TLS)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("redis backend options tls_cert_file and tls_key_file go together")
        check_cluster_options(self.url, self.cluster, self.cluster_nodes, self.key_prefix,
                              int(parse_url(self.url).get("db") or 0))

    def connection_kwargs(self) -> dict[str, Any]:
        """redis-py connection arguments beyond the URL (TLS files)."""
        names = {"tls_ca_file": "ssl_ca_certs", "tls_cert_file": "ssl_certfile",
                 "tls_key_file": "ssl_keyfile"}
        return {names[n]: getattr(self, n) for n in _TLS_OPTIONS if getattr(self, n) is not None}

    @property
    def address(self) -> str:
        """Where the server is, for logs and errors (holds no password)."""
        return self.url


def _check_url(url: str) -> None:
    # Errors show the URL redacted: a wrong one may carry a password
    # (user:password@ or ?password=) that must not reach logs or answers.
    shown = _shown_url(url)
    try:
        parsed = parse_url(url)
    except ValueError as err:
        # urllib's port error quotes the port text, which may be a password
        # put in the wrong place (redis://host:hunter2).
        reason = "the port is not an integer in [0, 65535]" if "port" in str(err).lower() \
            else redacted(str(err))
        raise ValueError(f"invalid redis backend option url={shown!r}: {reason}") from None
    if urlsplit(url).password is not None:
        raise ValueError(
            f"invalid redis backend option url={shown!r}: it contains a password; "
            "put the password in the 'password' option instead"
        )
    extra = sorted(set(_query_keys(url)) - _URL_QUERY_KEYS)
    if extra:
        raise ValueError(
            f"invalid redis backend option url={shown!r}: query argument(s) {extra} are not "
            f"accepted (only {sorted(_URL_QUERY_KEYS)}); use the backend's options instead"
        )
    if "path" not in parsed and "host" not in parsed:
        raise ValueError(f"invalid redis backend option url={shown!r}: no host or socket path")


def _shown_url(url: str) -> str:
    """``url`` without its password and query values (names are kept)."""
    parts = urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    try:
        _ = parts.port
    except ValueError:  # not a port: perhaps a password in the wrong place
        host = f"{host.rpartition(':')[0]}:{REDACTED}"
    if user and ":" in user:
        user = f"{user.partition(':')[0]}:{REDACTED}"
    netloc = user + at + host
    query = "&".join(f"{name}=..." for name in _query_keys(url))
    return parts._replace(netloc=netloc, query=query, fragment="").geturl()


def _query_keys(url: str) -> list[str]:
    query = urlsplit(url).query
    return [part.split("=", 1)[0] for part in query.split("&") if part]
