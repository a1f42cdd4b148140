"""Backend registry: name -> (module, class), imported on first use.

``dynamic`` loads a user backend: its options carry ``module_path`` and
``class_name`` (a StorageBackend subclass); the remaining options go to it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from vllm_hicache.storage.base import StorageBackend, StorageContext

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_backend(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"storage backend {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def backend_names() -> tuple[str, ...]:
    return (*_REGISTRY, "dynamic")


def create_backend(name: str, options: Mapping[str, Any], ctx: StorageContext) -> StorageBackend:
    """Build the backend ``name`` (a value of ``hicache_storage_backend``)."""
    options = dict(options)
    if name == "dynamic":
        cls = _load_dynamic(options)
    elif name in _REGISTRY:
        module, class_name = _REGISTRY[name]
        cls = getattr(importlib.import_module(module), class_name)
    else:
        raise ValueError(
            f"unknown hicache_storage_backend {name!r}; accepted: {', '.join(backend_names())}"
        )
    return cls(options, ctx)


def _load_dynamic(options: dict[str, Any]) -> type[StorageBackend]:
    missing = [k for k in ("module_path", "class_name") if not isinstance(options.get(k), str)]
    if missing:
        raise ValueError(
            "hicache_storage_backend=dynamic needs string keys module_path and class_name "
            f"in hicache_storage_backend_extra_config; missing or not a string: {missing}"
        )
    module_path, class_name = options.pop("module_path"), options.pop("class_name")
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"hicache_storage_backend=dynamic: cannot load {module_path}.{class_name}: {err}"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ValueError(
            f"hicache_storage_backend=dynamic: {module_path}.{class_name} is not a "
            "vllm_hicache.storage.StorageBackend subclass"
        )
    return cls


register_backend("file", "vllm_hicache.storage.file", "FileBackend")
register_backend("redis", "vllm_hicache.storage.redis", "RedisBackend")
register_backend("mooncake", "vllm_hicache.storage.mooncake", "MooncakeBackend")
register_backend("nixl", "vllm_hicache.storage.nixl", "NixlBackend")
