import dataclasses

import pytest

from vllm_hicache.keys import KeyNamespace, block_hash_of_group_key, loadable_block_limit

NS = KeyNamespace("org/model", "bfloat16", "page_first", 32, 2, 0)


def test_keys_are_safe_and_deterministic():
    keys = NS.object_keys([b"\x01\x02", b"\xff"])
    assert keys == NS.object_keys([b"\x01\x02", b"\xff"])
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") for k in keys)
    assert keys[0].endswith("-r0-0102")


@pytest.mark.parametrize("field, value", [
    ("model", "other/model"), ("kv_dtype", "float16"), ("mem_layout", "layer_first"),
    ("block_size", 16), ("tp_size", 4), ("tp_rank", 1),
])
def test_every_field_changes_the_key(field, value):
    other = dataclasses.replace(NS, **{field: value})
    assert other.object_keys([b"x"]) != NS.object_keys([b"x"])


def test_mla_has_one_copy_for_all_ranks():
    mla = dataclasses.replace(NS, is_mla=True)
    assert mla.for_rank(1).object_keys([b"x"]) == mla.object_keys([b"x"])
    assert dataclasses.replace(mla, tp_size=8).object_keys([b"x"]) == mla.object_keys([b"x"])


def test_helpers():
    assert block_hash_of_group_key(b"abc" + (7).to_bytes(4, "big")) == b"abc"
    assert loadable_block_limit(64, 32) == 1
    assert loadable_block_limit(65, 32) == 2
    assert loadable_block_limit(0, 32) == 0
