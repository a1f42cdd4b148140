"""Options of the ``redis`` L3 backend, parsed once into a frozen dataclass.

The server is named by one ``url`` (redis-py's URL scheme); every other knob is
its own option, so the URL carries no secret and can be logged as it is:

    redis://HOST[:PORT][/DB]          TCP (default port 6379, db 0)
    rediss://HOST[:PORT][/DB]         TCP + TLS (system CA store)
    unix:///PATH/redis.sock[?db=N]    unix domain socket

A user name may appear in the URL (``redis://alice@host``, Redis 6 ACL); the
password may not: it goes in ``password``, which no repr or error shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_hicache.storage.options import check_range, reject_unknown, require
from urllib.parse import urlsplit

from redis.connection import parse_url

# URL query arguments we accept; the rest have an option of their own.
_URL_QUERY_KEYS = frozenset({"db"})
# Bounds that keep a failing start under 30 s (see redis_wire.probe_server).
_MAX_CONNECT_TIMEOUT_S = 5.0
_MAX_STARTUP_WAIT_S = 15.0


@dataclass(frozen=True)
class RedisConfig:
    # Server address (see the module docstring); required.
    url: str
    # AUTH password (``requirepass`` or the ACL user's); never shown.
    password: str | None = field(default=None, repr=False)
    # Prepended to every object key. Must be non-empty: clear() deletes the
    # keys matching ``key_prefix*`` and nothing else.
    key_prefix: str = "hicache:"
    # Bound on one socket read or write; a call against a hung server fails
    # (as misses) after about this long.
    socket_timeout_s: float = 2.0
    # Bound on opening one connection.
    connect_timeout_s: float = 2.0
    # Connections per process (pool size); threads beyond it wait for one,
    # up to socket_timeout_s.
    max_connections: int = 16
    # Most commands sent in one pipeline (one round trip).
    batch_size: int = 128
    # Most object bytes in one pipeline (a bigger object goes alone). Small
    # chunks keep the server's reply buffers and ours hot in cache: GET of
    # 1 MiB objects ran 2-4x faster with 2-4 MiB chunks than with 64 MiB.
    batch_bytes: int = 4 << 20
    # At start, keep retrying an unreachable server for this long (it may be
    # starting alongside vLLM) before giving up.
    startup_wait_s: float = 5.0

    def __post_init__(self) -> None:
        _check_url(self.url)
        prefix = self.key_prefix
        if not prefix or not prefix.isascii() or not prefix.isprintable():
            raise ValueError(
                f"invalid redis backend option key_prefix={prefix!r}: a non-empty printable "
                "ASCII string is required (clear() deletes every key starting with it)"
            )
        check_range("redis", "socket_timeout_s", self.socket_timeout_s, 0.0, 600.0)
        check_range("redis", "connect_timeout_s", self.connect_timeout_s, 0.0, _MAX_CONNECT_TIMEOUT_S)
        check_range("redis", "startup_wait_s", self.startup_wait_s, 0.0, _MAX_STARTUP_WAIT_S, with_low=True)
        check_range("redis", "max_connections", self.max_connections, 0, 4096)
        check_range("redis", "batch_size", self.batch_size, 0, 1 << 20)
        check_range("redis", "batch_bytes", self.batch_bytes, 0, 1 << 40)

    @property
    def address(self) -> str:
        """Where the server is, for logs and errors (holds no password)."""
        return self.url

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RedisConfig:
        """Validate ``options`` (names, types, ranges) into a config."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        reject_unknown("redis", options, fields)
        require("redis", options, "url", "e.g. redis://127.0.0.1:6379/0 or unix:///run/redis/redis.sock")
        values = {name: _coerce(name, fields[name].type, v) for name, v in options.items()}
        return cls(**values)


def _coerce(name: str, annotation: str, value: Any) -> Any:
    """One option's value as its field's type (annotations are strings here)."""
    if annotation == "str | None" and value is None:
        return None
    if annotation in ("str", "str | None"):
        if isinstance(value, str):
            return value
    elif annotation == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    else:
        raise AssertionError(f"no coercion for {name}: {annotation}")
    raise ValueError(f"invalid redis backend option {name}={value!r}: expected {annotation}")




def _check_url(url: str) -> None:
    try:
        parsed = parse_url(url)
    except ValueError as err:
        raise ValueError(f"invalid redis backend option url={url!r}: {err}") from None
    if urlsplit(url).password is not None:
        # Do not echo the URL: it holds the secret.
        raise ValueError(
            "invalid redis backend option url: it contains a password; "
            "put the password in the 'password' option instead"
        )
    extra = sorted(set(_query_keys(url)) - _URL_QUERY_KEYS)
    if extra:
        raise ValueError(
            f"invalid redis backend option url={url!r}: query argument(s) {extra} are not "
            f"accepted (only {sorted(_URL_QUERY_KEYS)}); use the backend's options instead"
        )
    if "path" not in parsed and "host" not in parsed:
        raise ValueError(f"invalid redis backend option url={url!r}: no host or socket path")


def _query_keys(url: str) -> list[str]:
    query = urlsplit(url).query
    return [part.split("=", 1)[0] for part in query.split("&") if part]
