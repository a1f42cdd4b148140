"""Which calls the admin API takes, and what their bodies may name.

Who may call (admin_api.py's middleware): a page of another
site must not be able to drive a loopback API from a browser. Bound to
loopback, ``Host`` must name the bound address or ``localhost`` with the port
(a DNS-rebound name is refused); an ``Origin`` header must be the same origin;
POST and PUT need ``Content-Type: application/json`` (which a browser does
not send cross-site without a preflight that this API never grants); and a
body nests at most a few levels, checked before the JSON parser recurses.

What a body may name: a client of the admin API is not the operator; options
it sends must not turn the engine into a reader of local files (a Redis
``password`` of ``@/home/u/.ssh/id_ed25519`` is sent in ``AUTH`` to a server
the client chose) or an importer of arbitrary modules (backend ``dynamic``).
Invariant, checked on an attach body before anything else parses it:

- a file is named (an ``@/path`` string anywhere in the options, at any
  depth, or a ``*_file`` option such as ``tls_ca_file``) only if its real
  path (symbolic links and ``..`` resolved) lies inside a directory of the
  operator's ``admin_api_file_dirs``; the refusal is the same whether or not
  the file exists, so it reveals nothing about files outside them;
- backend ``dynamic`` names a ``module_path`` listed in the operator's
  ``admin_api_dynamic_modules``, so nothing else is ever imported.

The engine's own configuration (kv_connector_extra_config) is the
operator's and is not checked here. Pure module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hicache.config_admin import is_loopback

# --- who may call ------------------------------------------------------------------


def allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """The ``Host`` headers a call to an API bound to ``host:port`` may
    carry: on loopback the bound address and ``localhost``; None (any) off
    loopback, where a key is always required (config._check_admin_bind)."""
    if not is_loopback(host):
        return None
    names = {"localhost"}
    names |= {"127.0.0.1", "[::1]"} if host == "localhost" else {
        f"[{host}]" if ":" in host else host}
    return frozenset(f"{name}:{port}" for name in names)


def origin_problem(headers: Any, hosts: frozenset[str] | None) -> tuple[str, str]:
    """(header, why) when a call's Host or Origin is foreign, else ("", "")."""
    host = headers.get("host", "").lower()
    if hosts is not None and host not in hosts:
        return "Host", (f"Host {host!r} is not this admin API's address (accepted: "
                        f"{', '.join(sorted(hosts))}); a page of another site cannot call it")
    origin = headers.get("origin")
    if origin is not None and origin.lower() != f"http://{host}":
        return "Origin", (f"Origin {origin!r} is not this admin API's (http://{host}); "
                          "cross-site calls are refused")
    return "", ""


def content_type_problem(method: str, content_type: str | None) -> str:
    """Why a call's Content-Type is refused ("" when it is not)."""
    if method not in ("POST", "PUT", "DELETE") or (method == "DELETE" and content_type is None):
        return ""
    if (content_type or "").partition(";")[0].strip().lower() == "application/json":
        return ""
    return (f"{method} needs the header Content-Type: application/json (got "
            f"{content_type!r})")


def json_depth(raw: bytes | bytearray, limit: int) -> int:
    """How deep ``raw``'s arrays and objects nest, counted up to ``limit + 1``."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


# --- what a body may name --------------------------------------------------------

# Options whose value is the path of a file a backend reads (redis TLS).
_FILE_OPTION_SUFFIX = "_file"


@dataclass(frozen=True)
class AdminPolicy:
    """The operator's allow-lists (config.py: admin_api_file_dirs,
    admin_api_dynamic_modules); empty = nothing allowed."""

    # Real paths of directories.
    file_dirs: tuple[str, ...] = ()
    dynamic_modules: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: Any) -> AdminPolicy:
        return cls(tuple(cfg.admin_api_file_dirs), tuple(cfg.admin_api_dynamic_modules))

    def check_attach(self, backend: str, options: Mapping[str, Any]) -> None:
        """Raise ValueError saying what the options may not name."""
        for where, path in named_files(options):
            if not self.allows_file(path):
                allowed = ("none are set" if not self.file_dirs
                           else "this one is not inside one of them")
                raise ValueError(
                    f"option {where} names a file; the admin API reads only files inside "
                    f"the directories of the engine's admin_api_file_dirs, and {allowed} "
                    "(send the value inline, or ask the operator to allow its directory)")
        if backend == "dynamic":
            module = options.get("module_path")
            if not isinstance(module, str) or module not in self.dynamic_modules:
                raise ValueError(
                    f"backend 'dynamic' with module_path={module!r}: the admin API imports "
                    "only the modules listed in the engine's admin_api_dynamic_modules"
                    + ("" if self.dynamic_modules else " (none are)"))

    def allows_file(self, path: str) -> bool:
        real = os.path.realpath(path)
        return any(os.path.commonpath([real, root]) == root for root in self.file_dirs)


def named_files(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(option name, path) for every file ``value`` names: ``@path`` strings
    and the values of ``*_file`` options, at any depth."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = f"{where}.{key}" if where else str(key)
            if str(key).endswith(_FILE_OPTION_SUFFIX) and isinstance(item, str):
                yield name, item
            yield from named_files(item, name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from named_files(item, f"{where}[{i}]")
    elif isinstance(value, str) and value.startswith("@"):
        yield where, value[1:]
