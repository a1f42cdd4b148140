"""What an admin API client may make the engine read or import.

A client of the admin API is not the operator: options it sends must not
turn the engine into a reader of local files (a Redis ``password`` of
``@/home/u/.ssh/id_ed25519`` is sent in ``AUTH`` to a server the client
chose) or an importer of arbitrary modules (backend ``dynamic``).

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
