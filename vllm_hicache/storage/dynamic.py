"""``dynamic``: a user's StorageBackend subclass, named in its options.

``hicache_storage_backend_extra_config`` carries ``module_path`` and
``class_name``; they are taken out, and the remaining options go to the
class, which parses them itself. The class is imported when the backend is
built, in every process that builds one, so its module must be importable
there.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_hicache.storage.base import StorageBackend

NAME = "dynamic"
_LOADER_KEYS = ("module_path", "class_name")


def load_user_backend(options: dict[str, Any]) -> type[StorageBackend]:
    """The class named by ``options`` (whose loader keys are popped)."""
    missing = [k for k in _LOADER_KEYS if not isinstance(options.get(k), str)]
    if missing:
        raise ValueError(
            f"hicache_storage_backend={NAME} needs string keys module_path and class_name "
            f"in hicache_storage_backend_extra_config; missing or not a string: {missing}"
        )
    module_path, class_name = options.pop("module_path"), options.pop("class_name")
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"hicache_storage_backend={NAME}: cannot load {module_path}.{class_name}: {err}"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ValueError(
            f"hicache_storage_backend={NAME}: {module_path}.{class_name} is not a "
            "vllm_hicache.storage.StorageBackend subclass"
        )
    return cls
