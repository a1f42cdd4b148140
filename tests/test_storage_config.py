import json

import pytest

from tests.conftest import make_config


def test_no_storage_by_default():
    assert make_config().storage is None


def test_backend_policy_and_knobs_parsed():
    cfg = make_config(
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="timeout",
        hicache_storage_backend_extra_config={
            "prefetch_threshold": 64, "prefetch_timeout_base": 1, "path": "/x",
        },
    )
    st = cfg.storage
    assert (st.backend, st.prefetch_policy, st.prefetch_threshold) == ("file", "timeout", 64)
    assert st.prefetch_timeout_base == 1.0
    assert dict(st.backend_options) == {"path": "/x"}  # knobs taken out
    with pytest.raises(TypeError):
        st.backend_options["path"] = "/y"  # frozen


def test_extra_config_as_json_and_file(tmp_path):
    assert make_config(
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config='{"path": "/a"}',
    ).storage.backend_options["path"] == "/a"
    f = tmp_path / "l3.json"
    f.write_text(json.dumps({"path": "/b", "prefetch_threshold": 32}))
    st = make_config(hicache_storage_backend="file",
                     hicache_storage_backend_extra_config=f"@{f}").storage
    assert (st.backend_options["path"], st.prefetch_threshold) == ("/b", 32)
    t = tmp_path / "l3.toml"
    t.write_text('path = "/c"\n')
    cfg = make_config(hicache_storage_backend="file", hicache_storage_backend_extra_config=f"@{t}")
    assert cfg.storage.backend_options["path"] == "/c"


@pytest.mark.parametrize("extra, match", [
    ({"hicache_storage_backend": "s3"}, "hicache_storage_backend='s3'; accepted: file, redis"),
    ({"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "eager"},
     "hicache_storage_prefetch_policy='eager'; accepted: best_effort"),
    ({"hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": {"prefetch_threshold": 0}}, "prefetch_threshold=0"),
    ({"hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": {"prefetch_threshold": 1.5}},
     "prefetch_threshold=1.5"),
    ({"hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": {"prefetch_timeout_base": -1}},
     "prefetch_timeout_base"),
    ({"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": "{not json"},
     "hicache_storage_backend_extra_config"),
    ({"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": "[1, 2]"},
     "expected a JSON object"),
    ({"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": "@/nope.json"},
     "hicache_storage_backend_extra_config"),
    ({"hicache_storage_prefetch_policy": "timeout"}, "without hicache_storage_backend"),
])
def test_bad_storage_config(extra, match):
    with pytest.raises(ValueError, match=match):
        make_config(**extra)


# --- storage_secret / storage_encrypt -------------------------------------------

SECRET = "0123456789abcdef-not-for-any-log"


def security(**options):
    return make_config(hicache_storage_backend="file",
                       hicache_storage_backend_extra_config={"path": "/x", **options}).storage


def test_secret_inline_and_from_file(tmp_path):
    inline = security(storage_secret=SECRET)
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    from_file = security(storage_secret=f"@{f}", storage_encrypt=True)
    assert inline.secret == from_file.secret
    assert (inline.protection, from_file.protection) == ("gmac", "aead")
    assert inline.key_protection == "gmac:" + inline.secret.namespace_tag
    assert dict(from_file.backend_options) == {"path": "/x"}  # never reaches the backend
    assert security().secret is None and security().key_protection == ""
    assert security(storage_secret=SECRET + "x").key_protection != inline.key_protection


@pytest.mark.parametrize("options, match", [
    ({"storage_secret": "short"}, "storage_secret: 5 bytes, expected 16"),
    ({"storage_secret": 12345678901234567890}, "storage_secret: expected a non-empty string"),
    ({"storage_secret": ""}, "storage_secret: expected a non-empty string"),
    ({"storage_secret": "@/no/such/file"},
     "storage_secret: cannot read the file '/no/such/file'"),
    ({"storage_encrypt": True}, "storage_encrypt=true needs storage_secret"),
    ({"storage_secret": SECRET, "storage_encrypt": "yes"}, "invalid storage_encrypt='yes'"),
])
def test_bad_security_options(options, match):
    with pytest.raises(ValueError, match=match) as err:
        security(**options)
    assert SECRET not in str(err.value)


def test_short_secret_file_names_the_file_not_the_secret(tmp_path):
    f = tmp_path / "secret"
    f.write_text("tiny-secret\n")
    with pytest.raises(ValueError, match=f"11 bytes.*{f}") as err:
        security(storage_secret=f"@{f}")
    assert "tiny-secret" not in str(err.value)


def test_secret_never_shown_in_repr_or_errors():
    st = security(storage_secret=SECRET)
    cfg = make_config(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config={"storage_secret": SECRET})
    for text in (repr(st), str(st), repr(cfg), repr(st.secret), f"{st.secret}", st.key_protection):
        assert SECRET not in text
    # An extra config given as a JSON string is never echoed: it may hold the secret.
    for bad in ('{"storage_secret": "' + SECRET + '", ', '["' + SECRET + '"]'):
        with pytest.raises(ValueError, match="hicache_storage_backend_extra_config") as err:
            make_config(hicache_storage_backend="file", hicache_storage_backend_extra_config=bad)
        assert SECRET not in str(err.value)
    # An unknown option is named; the secret beside it is not shown.
    with pytest.raises(ValueError, match="no_such_option") as err:
        from vllm_hicache.storage import StorageContext, create_backend

        create_backend("file", {**st.backend_options, "no_such_option": 1},
                       StorageContext("worker", 0, 1, 128))
    assert SECRET not in str(err.value)


def test_secret_and_config_files_are_bounded_regular_files(tmp_path):
    """storage_secret and an @file extra config read no device, FIFO or large
    file: a clear error at once, naming the option and the limit."""
    import os
    import time

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"path": "/x" * 40_000}))
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    start = time.monotonic()
    for path, problem in ((zero, "not a regular file"), (fifo, "not a regular file"),
                          (big, "larger than the limit of 65536 bytes")):
        with pytest.raises(ValueError, match=f"^invalid storage_secret: .*'{path}': {problem}"):
            security(storage_secret=f"@{path}")
        with pytest.raises(ValueError, match=f"^invalid hicache_storage_backend_extra_config "
                                             f"'@{path}': .*{problem}"):
            make_config(hicache_storage_backend="file",
                        hicache_storage_backend_extra_config=f"@{path}")
    assert time.monotonic() - start < 5


def test_inline_backend_secrets_are_redacted_in_reprs():
    """repr(StorageConfig) and repr(HiCacheConfig) show a backend's options
    with every secret-named value, at any depth, and URL secrets redacted."""
    cfg = make_config(hicache_storage_backend="nixl", hicache_storage_backend_extra_config={
        "plugin": "OBJ", "bucket": "b", "access_key": "AKIA-ACCESS-0001",
        "secret_key": "S3-SECRET-0002", "obj_backend_params": {"session_token": "TOK-0003"},
        "endpoint_override": "https://u:PW-0004@s3.local/?x=1&auth_token=TOK-0005",
        "storage_secret": SECRET})
    for text in (repr(cfg), repr(cfg.storage), str(cfg)):
        for secret in ("AKIA-ACCESS-0001", "S3-SECRET-0002", "TOK-0003", "PW-0004", "TOK-0005",
                       SECRET):
            assert secret not in text, (secret, text)
        assert "bucket': 'b'" in text and "x=1" in text and "<redacted>" in text
    assert dict(cfg.storage.backend_options)["secret_key"] == "S3-SECRET-0002"  # still usable
