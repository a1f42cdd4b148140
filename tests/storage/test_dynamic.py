"""``dynamic``: a user backend loaded by module path and class name passes the
conformance suite; bad module paths and classes fail with a clear ValueError."""

from __future__ import annotations

import pytest

from tests.storage.conformance import BackendConformance, empty, keys, make, obj, same
from vllm_hicache.storage import StorageContext, create_backend

USER = {"module_path": "tests.storage.user_backend", "class_name": "MemoryBackend"}
CTX = StorageContext("worker", 0, 1, 64 + 4096)


@pytest.fixture
def spec(tmp_path):
    # Persisted so the conformance suite's second process sees the objects.
    return ("dynamic", {**USER, "persist_dir": str(tmp_path / "objects")})


@pytest.fixture
def backend(spec):
    b = make(spec)
    yield b
    b.close()


class TestDynamicConformance(BackendConformance):
    pass


def test_loads_the_user_class(backend):
    from tests.storage.user_backend import MemoryBackend

    assert type(backend) is MemoryBackend


def test_memory_only_round_trip():
    b = create_backend("dynamic", USER, CTX)
    ks = keys(2)
    assert b.put(ks, [obj(0), obj(1)]) == [True, True]
    targets = [empty(), empty()]
    assert b.get(ks, targets) == [True, True] and same(targets[1], obj(1))


def test_options_reach_the_user_class_without_the_loader_keys():
    with pytest.raises(ValueError, match="unknown memory backend option.*surprise"):
        create_backend("dynamic", {**USER, "surprise": 1}, CTX)


@pytest.mark.parametrize("missing", ["module_path", "class_name"])
def test_missing_loader_key(missing):
    options = {k: v for k, v in USER.items() if k != missing}
    with pytest.raises(ValueError, match=f"dynamic.*{missing}"):
        create_backend("dynamic", options, CTX)


def test_loader_key_must_be_a_string():
    with pytest.raises(ValueError, match="class_name"):
        create_backend("dynamic", {**USER, "class_name": 3}, CTX)


def test_module_that_does_not_exist():
    with pytest.raises(ValueError, match="cannot load no_such_pkg.mod.MemoryBackend"):
        create_backend("dynamic", {**USER, "module_path": "no_such_pkg.mod"}, CTX)


def test_class_that_does_not_exist():
    with pytest.raises(ValueError, match="cannot load tests.storage.user_backend.Nope"):
        create_backend("dynamic", {**USER, "class_name": "Nope"}, CTX)


@pytest.mark.parametrize("class_name", ["NotABackend", "re"])
def test_class_that_is_not_a_storage_backend(class_name):
    with pytest.raises(ValueError, match="not a vllm_hicache.storage.StorageBackend subclass"):
        create_backend("dynamic", {**USER, "class_name": class_name}, CTX)
