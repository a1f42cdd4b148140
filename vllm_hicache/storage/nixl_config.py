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

import dataclasses
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PLUGINS = ("POSIX", "OBJ")
_POSIX_ONLY = ("path", "posix_backend_params")
_OBJ_ONLY = ("bucket", "endpoint_override", "region", "access_key", "secret_key",
             "scheme", "key_prefix", "obj_backend_params")
# Linux AIO (libaio). Not POSIX AIO: with use_posix_aio one failed I/O (e.g.
# a short read) stays at the head of the plugin's shared queue, and every later
# transfer of the agent fails (NIXL 1.5.1, verified); AIO and io_uring recover.
_DEFAULT_POSIX_PARAMS = {"use_aio": "true"}
# Path-style URLs work with every S3-compatible server; AWS accepts them too.
_DEFAULT_OBJ_PARAMS = {"use_virtual_addressing": "false", "req_checksum": "supported"}


@dataclass(frozen=True)
class NixlConfig:
    # NIXL storage plugin: "POSIX" (files) or "OBJ" (S3 objects).
    plugin: str = "POSIX"
    # POSIX: directory of the objects (created if missing; must be writable).
    path: str | None = None
    # POSIX: parameters of NIXL's POSIX plugin: {"use_aio": "true"} (libaio),
    # {"use_uring": "true"}, {"use_posix_aio": "true"} (not recommended, see
    # above), "ios_pool_size", "kernel_queue_size"; {} = the plugin's default.
    posix_backend_params: Mapping[str, str] = field(
        default_factory=lambda: dict(_DEFAULT_POSIX_PARAMS))
    # OBJ: bucket holding the objects (must exist).
    bucket: str | None = None
    # OBJ: S3 endpoint URL, e.g. "http://127.0.0.1:9000"; None = AWS.
    endpoint_override: str | None = None
    # OBJ: S3 region.
    region: str = "us-east-1"
    # OBJ: credentials; None = the AWS default chain (environment, profile).
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    # OBJ: "http" or "https"; None = the endpoint URL's scheme, else "https".
    scheme: str | None = None
    # OBJ: prepended to every object name; clear() deletes only names with it.
    key_prefix: str = "hicache/"
    # OBJ: extra parameters of NIXL's OBJ plugin (merged over path-style
    # addressing and req_checksum=supported), e.g. {"crtMinLimit": "10485760"}.
    obj_backend_params: Mapping[str, str] = field(
        default_factory=lambda: dict(_DEFAULT_OBJ_PARAMS))
    # Name of this process's NIXL agent; None = unique per backend instance.
    agent_name: str | None = None
    # Bound on one get/put call's transfers; a transfer still running then is
    # a miss (or failed put).
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.plugin not in PLUGINS:
            raise ValueError(f"invalid nixl backend option plugin={self.plugin!r}; "
                             f"accepted: {PLUGINS}")
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"invalid nixl backend option timeout_s={self.timeout_s!r}: "
                             "must be in (0, 600]")
        if self.plugin == "POSIX" and not self.path:
            raise ValueError("nixl backend with plugin=POSIX needs option 'path' (a directory)")
        if self.plugin == "OBJ":
            if not self.bucket:
                raise ValueError("nixl backend with plugin=OBJ needs option 'bucket'")
            if self.scheme not in (None, "http", "https"):
                raise ValueError(f"invalid nixl backend option scheme={self.scheme!r}; "
                                 "accepted: 'http', 'https'")
            if not self.key_prefix or not self.key_prefix.isascii():
                raise ValueError(f"invalid nixl backend option key_prefix={self.key_prefix!r}: "
                                 "a non-empty ASCII string is required (clear() deletes "
                                 "every object name starting with it)")

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

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> NixlConfig:
        """Validate ``options`` (names, types, plugin fit) into a config."""
        accepted = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(f"unknown nixl backend option(s) {unknown}; accepted: {accepted}")
        values = dict(options)
        plugin = values.get("plugin", "POSIX")
        values["plugin"] = plugin.upper() if isinstance(plugin, str) else plugin
        foreign = _OBJ_ONLY if values["plugin"] == "POSIX" else _POSIX_ONLY
        misplaced = sorted(k for k in foreign if k in values)
        if misplaced:
            raise ValueError(f"nixl backend option(s) {misplaced} do not apply to "
                             f"plugin={values['plugin']!r}")
        for name, value in values.items():
            values[name] = _coerce(name, value)
        return cls(**values)


_STRINGS = ("plugin", "path", "bucket", "endpoint_override", "region", "access_key",
            "secret_key", "scheme", "key_prefix", "agent_name")


def _coerce(name: str, value: Any) -> Any:
    if name in _STRINGS:
        if isinstance(value, str) or (value is None and name not in ("plugin", "region")):
            return os.path.expanduser(value) if name == "path" and value else value
        shown = "<hidden>" if name in ("access_key", "secret_key") else repr(value)
        raise ValueError(f"invalid nixl backend option {name}={shown}: expected a string")
    if name == "timeout_s":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"invalid nixl backend option timeout_s={value!r}: expected seconds")
    return _coerce_params(name, value)


def _coerce_params(name: str, value: Any) -> dict[str, str]:
    """A plugin parameter map: string keys; str/bool/int values as NIXL strings."""
    if not isinstance(value, Mapping):
        raise ValueError(f"invalid nixl backend option {name}={value!r}: expected a mapping")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, (str, bool, int)):
            raise ValueError(f"invalid nixl backend option {name}: entry {key!r}={item!r} "
                             "must map a string to a string, bool or int")
        out[key] = str(item).lower() if isinstance(item, bool) else str(item)
    return out
