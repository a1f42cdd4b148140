"""Options of the ``nixl`` L3 backend, parsed once into a frozen dataclass.

Two NIXL plugins are supported, chosen by ``plugin``:

- ``POSIX``: objects are files under ``path`` (local disk or a shared file
  system), moved by NIXL's POSIX plugin (libaio / POSIX AIO / io_uring).
- ``OBJ``: objects live in an S3 bucket (AWS or any S3-compatible server),
  moved by NIXL's OBJ plugin; listing and deleting (``clear``) and the
  start-up reachability check go through boto3.

Options that belong to the other plugin are refused rather than ignored, so a
typo cannot silently configure the wrong store. Secrets never appear in a
repr or an error message.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hicache.storage.options import (
    Options,
    choice,
    directory,
    flag,
    number,
    option,
    optional,
    parse_options,
    permissions,
    string_map,
    text,
)

PLUGINS = ("POSIX", "OBJ")
_POSIX_ONLY = ("path", "posix_backend_params", "file_mode", "dir_mode", "allow_shared_dir")
_OBJ_ONLY = ("bucket", "endpoint_override", "region", "access_key", "secret_key",
             "scheme", "key_prefix", "obj_backend_params")
# Linux AIO (libaio). Not POSIX AIO: with use_posix_aio one failed I/O (e.g.
# a short read) stays at the head of the plugin's shared queue, and every later
# transfer of the agent fails (NIXL 1.5.1, verified); AIO and io_uring recover.
_DEFAULT_POSIX_PARAMS = {"use_aio": "true"}
# Path-style URLs work with every S3-compatible server; AWS accepts them too.
_DEFAULT_OBJ_PARAMS = {"use_virtual_addressing": "false", "req_checksum": "supported"}


@dataclass(frozen=True)
class NixlConfig(Options):
    owner = "nixl backend"

    # NIXL storage plugin: "POSIX" (files) or "OBJ" (S3 objects); any case.
    plugin: str = option("POSIX", parse=choice(*PLUGINS, ignore_case=True))
    # POSIX: directory of the objects (created if missing; must be writable at
    # start). One file per key in 256 fan-out directories (posix.py).
    path: str | None = option(None, parse=optional(directory))
    # POSIX: parameters of NIXL's POSIX plugin: {"use_aio": "true"} (libaio),
    # {"use_uring": "true"}, {"use_posix_aio": "true"} (not recommended, see
    # above), "ios_pool_size", "kernel_queue_size"; {} = the plugin's default.
    posix_backend_params: Mapping[str, str] = option(
        default_factory=lambda: dict(_DEFAULT_POSIX_PARAMS), parse=string_map)
    # POSIX: permissions of the files and directories the store creates,
    # exactly (the umask does not apply), as the file backend's: owner-only
    # by default, e.g. "0660"/"0770" with allow_shared_dir for a store shared
    # by a group. Modes letting others write, or a store directory others can
    # write (owner, group, world, ACL), are refused unless allow_shared_dir.
    file_mode: int = option(0o600, parse=permissions(0o600))
    dir_mode: int = option(0o700, parse=permissions(0o700))
    allow_shared_dir: bool = option(False, parse=flag)
    # OBJ: bucket holding the objects (must exist; needs boto3 for the
    # start-up check and clear).
    bucket: str | None = option(None, parse=optional(text(empty=False)))
    # OBJ: S3 endpoint URL, e.g. "http://127.0.0.1:9000"; None = AWS.
    endpoint_override: str | None = option(None, parse=optional(text()))
    # OBJ: S3 region.
    region: str = option("us-east-1", parse=text())
    # OBJ: credentials; None = the AWS default chain (environment, profile).
    # Never shown.
    access_key: str | None = option(None, parse=optional(text()), repr=False)
    secret_key: str | None = option(None, parse=optional(text()), repr=False)
    # OBJ: "http" or "https"; None = the endpoint URL's scheme, else "https".
    scheme: str | None = option(None, parse=optional(choice("http", "https")))
    # OBJ: prepended to every object name; clear() deletes only names with it.
    key_prefix: str = option("hicache/", parse=text(empty=False, printable=True),
                             hint="clear() deletes every object name starting with it")
    # OBJ: extra parameters of NIXL's OBJ plugin (merged over path-style
    # addressing and req_checksum=supported), e.g. {"crtMinLimit": "10485760"}.
    obj_backend_params: Mapping[str, str] = option(
        default_factory=lambda: dict(_DEFAULT_OBJ_PARAMS), parse=string_map)
    # Name of this process's NIXL agent; None = hicache-<pid>-<random>,
    # unique per backend instance.
    agent_name: str | None = option(None, parse=optional(text(empty=False)))
    # Bound on one get/put call's transfers; a transfer still running then is
    # a miss (or failed put): it is reaped later, and touches only its
    # staging slot meanwhile.
    timeout_s: float = option(10.0, parse=number(0.0, 600.0, low_open=True))

    def __post_init__(self) -> None:
        if self.plugin == "POSIX" and not self.path:
            raise ValueError("nixl backend with plugin=POSIX needs option 'path' (a directory)")
        if self.plugin == "OBJ" and not self.bucket:
            raise ValueError("nixl backend with plugin=OBJ needs option 'bucket'")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> NixlConfig:
        """Parse ``options``; those of the other plugin are refused rather
        than ignored, so a typo cannot silently configure the wrong store."""
        plugin = str(options.get("plugin", "POSIX")).upper()
        foreign = _OBJ_ONLY if plugin == "POSIX" else _POSIX_ONLY
        misplaced = sorted(k for k in foreign if k in options)
        if misplaced and plugin in PLUGINS:  # else the plugin's own error
            raise ValueError(f"nixl backend option(s) {misplaced} do not apply to "
                             f"plugin={plugin!r}")
        return parse_options(cls, options)

    @property
    def resolved_agent_name(self) -> str:
        return self.agent_name or f"hicache-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @property
    def endpoint_url(self) -> str | None:
        """The OBJ endpoint with an explicit scheme (what boto3 needs)."""
        ep = self.endpoint_override
        if ep is None or "://" in ep:
            return ep
        return f"{self.scheme or 'https'}://{ep}"

    def plugin_params(self) -> dict[str, str]:
        """The parameters handed to NIXL's ``create_backend``."""
        if self.plugin == "POSIX":
            return dict(self.posix_backend_params)
        params = {**_DEFAULT_OBJ_PARAMS, **self.obj_backend_params,
                  "bucket": str(self.bucket), "region": self.region}
        if self.endpoint_override:
            params["endpoint_override"] = str(self.endpoint_url)
        scheme = self.scheme or (self.endpoint_url or "https").split("://", 1)[0]
        params["scheme"] = scheme
        if self.access_key is not None:
            params["access_key"] = self.access_key
        if self.secret_key is not None:
            params["secret_key"] = self.secret_key
        return params
