import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_hicache.keys import KeyNamespace, block_hash_of_group_key, loadable_block_limit

NS = KeyNamespace("org/model", "bfloat16", "page_first", 32, 2, 0,
                  page_format="2B[plane2:256 token8:32 layer2:16 head2:8 elem8:1]",
                  weights_fingerprint="f" * 32)


def test_keys_are_safe_and_deterministic():
    keys = NS.object_keys([b"\x01\x02", b"\xff"])
    assert keys == NS.object_keys([b"\x01\x02", b"\xff"])
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") for k in keys)
    assert keys[0].startswith("hc3-")
    assert keys[0].endswith("-r0-0102")


@pytest.mark.parametrize("field, value", [
    ("model", "other/model"), ("kv_dtype", "float16"), ("mem_layout", "layer_first"),
    ("block_size", 16), ("tp_size", 4), ("tp_rank", 1),
    # Same layout name, other device block order (page_first_direct NHD vs HND).
    ("page_format", "2B[layer2:256 token8:32 head2:16 plane2:8 elem8:1]"),
    ("model_version", "v2"), ("weights_fingerprint", "e" * 32), ("pp_size", 2),
    # Another storage secret's tag, or encryption on (keys.py: protection).
    ("protection", "mac:0123456789abcdef"), ("protection", "aead:0123456789abcdef"),
])
def test_every_field_changes_the_key(field, value):
    other = dataclasses.replace(NS, **{field: value})
    assert other.tag != NS.tag
    assert other.object_keys([b"x"]) != NS.object_keys([b"x"])


def test_pp_rank_changes_the_key():
    stage0 = dataclasses.replace(NS, pp_size=2)
    stage1 = stage0.for_rank(0, pp_rank=1)
    assert stage1.pp_rank == 1 and stage1.tp_rank == 0
    assert stage0.tag != stage1.tag
    assert stage0.object_keys([b"x"])[0].endswith("-p0r0-78")
    assert stage1.object_keys([b"x"])[0].endswith("-p1r0-78")
    # for_rank keeps the PP rank unless told otherwise.
    assert stage1.for_rank(1).pp_rank == 1


def test_free_form_fields_cannot_imitate_each_other():
    a = dataclasses.replace(NS, model="org/model|v2", model_version="")
    b = dataclasses.replace(NS, model="org/model", model_version="v2")
    c = dataclasses.replace(NS, model="org/model", model_version="|v2")
    assert len({a.tag, b.tag, c.tag}) == 3


def test_mla_has_one_copy_for_all_tp_ranks_but_one_per_stage():
    mla = dataclasses.replace(NS, is_mla=True)
    assert mla.for_rank(1).object_keys([b"x"]) == mla.object_keys([b"x"])
    assert dataclasses.replace(mla, tp_size=8).object_keys([b"x"]) == mla.object_keys([b"x"])
    staged = dataclasses.replace(mla, pp_size=2)
    assert staged.for_rank(1, pp_rank=1).tag.endswith("-p1mla")
    assert staged.for_rank(0, pp_rank=1).tag != staged.tag


@pytest.mark.parametrize("fields", [
    {"tp_rank": 2}, {"tp_rank": -1}, {"pp_rank": 1}, {"pp_size": 2, "pp_rank": 2},
])
def test_bad_ranks_are_refused(fields):
    with pytest.raises(ValueError, match="bad L3 key shard"):
        dataclasses.replace(NS, **fields)


def test_tag_is_pinned():
    """The on-store format: a change here orphans every stored object, so it
    must come with a new KEY_VERSION."""
    assert NS.tag == _golden_tag()


def _golden_tag() -> str:
    import hashlib
    import json

    ident = json.dumps(["org/model", "", "f" * 32, "bfloat16", "page_first",
                        "2B[plane2:256 token8:32 layer2:16 head2:8 elem8:1]", 32, 2, 1, 0, ""])
    return f"hc3-{hashlib.sha256(ident.encode()).hexdigest()[:16]}-r0"


def test_tag_is_equal_across_processes_and_hash_seeds():
    script = textwrap.dedent("""
        from vllm_hicache.keys import KeyNamespace
        ns = KeyNamespace("org/model", "bfloat16", "page_first", 32, 2, 1, pp_size=2,
                          pp_rank=1, page_format="x", model_version="v", weights_fingerprint="f")
        print(ns.tag)
    """)
    tags = set()
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, check=True)
        tags.add(out.stdout.strip())
    assert len(tags) == 1
    assert tags.pop().endswith("-p1r1")


def test_helpers():
    assert block_hash_of_group_key(b"abc" + (7).to_bytes(4, "big")) == b"abc"
    assert loadable_block_limit(64, 32) == 1
    assert loadable_block_limit(65, 32) == 2
    assert loadable_block_limit(0, 32) == 0
