import json
import math

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


def test_timeout_formula_is_capped():
    st = make_config(hicache_storage_backend="file").storage
    assert math.isclose(st.prefetch_timeout_s(2048), 2.0 + 0.1 * 2)
    assert st.prefetch_timeout_s(10**9) == 30.0


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
    assert make_config(hicache_storage_backend="file",
                       hicache_storage_backend_extra_config=f"@{t}").storage.backend_options["path"] == "/c"


@pytest.mark.parametrize("extra, match", [
    ({"hicache_storage_backend": "s3"}, "hicache_storage_backend='s3'; accepted: file, redis"),
    ({"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "eager"},
     "hicache_storage_prefetch_policy='eager'; accepted: best_effort"),
    ({"hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": {"prefetch_threshold": 0}}, "prefetch_threshold=0"),
    ({"hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": {"prefetch_threshold": 1.5}}, "prefetch_threshold=1.5"),
    ({"hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": {"prefetch_timeout_base": -1}}, "prefetch_timeout_base"),
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
