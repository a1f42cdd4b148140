"""The registry: its names are what the configuration accepts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import make_config
from vllm_hicache.storage import (
    StorageContext,
    backend_names,
    create_backend,
    factory,
    register_backend,
)


@pytest.fixture(autouse=True)
def restore_registry():
    saved = dict(factory._REGISTRY)
    yield
    factory._REGISTRY.clear()
    factory._REGISTRY.update(saved)


def test_builtin_names_in_registration_order():
    assert backend_names() == ("file", "redis", "mooncake", "nixl", "dynamic")


def test_a_registered_backend_is_accepted_by_the_config():
    with pytest.raises(ValueError, match="accepted: file, redis, mooncake, nixl, dynamic"):
        make_config(hicache_storage_backend="memory")
    register_backend("memory", "tests.storage.user_backend", "MemoryBackend")
    assert make_config(hicache_storage_backend="memory").storage.backend == "memory"
    backend = create_backend("memory", {}, StorageContext("worker", 0, 1, 128))
    assert type(backend).__name__ == "MemoryBackend"


def test_duplicate_and_unknown_names_are_refused():
    for name in ("file", "dynamic"):
        with pytest.raises(ValueError, match="already registered"):
            register_backend(name, "x", "Y")
    with pytest.raises(ValueError, match="unknown hicache_storage_backend 's3'; accepted: file"):
        create_backend("s3", {}, StorageContext("worker", 0, 1, 128))


def test_registry_imports_without_numpy_or_backend_libraries():
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'torch', 'redis', 'mooncake', 'nixl'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from vllm_hicache.storage import backend_names\n"
        "import vllm_hicache.storage.options\n"
        "print(','.join(backend_names()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "file,redis,mooncake,nixl,dynamic"
