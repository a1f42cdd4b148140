from types import SimpleNamespace

import pytest

from vllm_hicache.connector.l3_setup import check_shareable_hashes


def fake_config(algo="sha256", pp=1):
    return SimpleNamespace(
        cache_config=SimpleNamespace(prefix_caching_hash_algo=algo),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
    )


def test_sha256_is_shareable():
    check_shareable_hashes(fake_config("sha256"))
    check_shareable_hashes(fake_config("sha256_cbor"))


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_random_seeded_hash_needs_pythonhashseed(monkeypatch, algo):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        check_shareable_hashes(fake_config(algo))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_shareable_hashes(fake_config(algo))


def test_pipeline_parallel_refused():
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_shareable_hashes(fake_config(pp=2))
