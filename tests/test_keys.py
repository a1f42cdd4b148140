import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from vllm_hicache.keys import KeyNamespace, block_hash_of_group_key, loadable_block_limit

NS = KeyNamespace("org/model", "bfloat16", "page_first", 32, 2, 0,
                  page_format="2B[plane2:256 token8:32 layer2:16 head2:8 elem8:1]",
                  weights_fingerprint="f" * 32)


def test_keys_are_safe_and_deterministic():
    keys = NS.object_keys([b"\x01\x02", b"\xff"])
    assert keys == NS.object_keys([b"\x01\x02", b"\xff"])
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") for k in keys)
    assert keys[0].startswith("hc4-")
    assert keys[0].endswith("-r0-0102")


@pytest.mark.parametrize("field, value", [
    ("model", "other/model"), ("kv_dtype", "float16"), ("mem_layout", "layer_first"),
    ("block_size", 16), ("tp_size", 4), ("tp_rank", 1),
    # Same layout name, other device block order (page_first_direct NHD vs HND).
    ("page_format", "2B[layer2:256 token8:32 head2:16 plane2:8 elem8:1]"),
    ("model_version", "v2"), ("weights_fingerprint", "e" * 32), ("pp_size", 2),
    # Online quantization, hf_overrides (l3_identity.weights_options).
    ("quantization", '{"config":null,"method":"fp8"}'), ("hf_overrides", '{"rope_theta":1}'),
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
                        "2B[plane2:256 token8:32 layer2:16 head2:8 elem8:1]", 32, 2, 1, 0, "",
                        "", ""])
    return f"hc4-{hashlib.sha256(ident.encode()).hexdigest()[:16]}-r0"


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


# --- head slices (heterogeneous TP, tp_lcm_size) ------------------------------


def sliced(tp_size: int, tp_rank: int, slices: int = 4) -> KeyNamespace:
    return dataclasses.replace(NS, tp_size=tp_size, tp_rank=tp_rank, head_slices=slices,
                               head_slice=tp_rank * (slices // tp_size))


def test_head_slicing_maps_ranks_onto_contiguous_slices():
    from vllm_hicache.keys import HeadSlicing

    s = HeadSlicing(num_slices=4, total_kv_heads=8, tp_size=2)
    assert (s.heads_per_slice, s.slices_per_rank) == (2, 2)
    assert [list(s.rank_slices(r)) for r in range(2)] == [[0, 1], [2, 3]]
    # Rank r's local heads [j*2, j*2+2) are global heads of slice r*2+j:
    # rank 1 holds global heads 4..7, i.e. slices 2 and 3.
    assert [list(HeadSlicing(4, 8, 4).rank_slices(r)) for r in range(4)] == [[0], [1], [2], [3]]
    assert list(HeadSlicing(4, 8, 1).rank_slices(0)) == [0, 1, 2, 3]


@pytest.mark.parametrize("slices, tp, heads, is_mla, match", [
    (3, 2, 6, False, "not a multiple of this instance's tensor_parallel_size=2"),
    (4, 8, 8, False, "not a multiple of this instance's tensor_parallel_size=8"),
    (4, 2, 6, False, "6 KV heads cannot be cut into 4 equal slices"),
    (2, 1, 2, True, "does not apply to MLA"),
])
def test_bad_head_slicing_is_refused_naming_the_key(slices, tp, heads, is_mla, match):
    from vllm_hicache.keys import HeadSlicing, check_head_slicing

    with pytest.raises(ValueError, match=match) as err:
        check_head_slicing(slices, tp, heads, is_mla)
    assert "tp_lcm_size" in str(err.value)
    if not is_mla:
        with pytest.raises(ValueError, match=match):
            HeadSlicing(slices, heads, tp)


def test_sliced_keys_do_not_depend_on_the_tp_size():
    whole = [ns.tag for ns in sliced(1, 0).page_namespaces()]
    for tp in (2, 4):
        per_rank = [ns.tag for r in range(tp) for ns in sliced(tp, r).page_namespaces()]
        assert per_rank == whole
    assert [t.rsplit("-", 1)[1] for t in whole] == ["s0", "s1", "s2", "s3"]
    assert sliced(2, 1).object_keys([b"\x07"]) == [whole[2] + "-07"]
    # Not the keys of per-rank objects, nor of another slicing.
    assert not set(whole) & {NS.for_rank(r).tag for r in range(2)}
    assert not set(whole) & {ns.tag for ns in sliced(1, 0, slices=2).page_namespaces()}
    # for_rank moves to the other rank's first slice.
    assert sliced(2, 0).for_rank(1) == sliced(2, 1)


def test_sliced_keys_still_carry_the_pp_rank():
    stage1 = dataclasses.replace(sliced(2, 1), pp_size=2, pp_rank=1)
    assert stage1.tag.endswith("-p1s2")
    assert stage1.tag != dataclasses.replace(stage1, pp_rank=0).tag


@pytest.mark.parametrize("head_slice", [0, 1, 4])
def test_a_slice_of_another_rank_is_refused(head_slice):
    with pytest.raises(ValueError, match="bad L3 key shard"):
        dataclasses.replace(NS, tp_size=2, tp_rank=1, head_slices=4, head_slice=head_slice)


def test_names_keyed_by_the_secret_hide_the_block_hash():
    """With a storage secret, an object's name is a keyed hash of the block
    hash: listing the store does not reveal which block hashes (prompts a
    lister can guess and hash as vLLM does) are cached."""
    hashes = [os.urandom(32) for _ in range(3)]
    plain = NS.object_keys(hashes)
    keyed = dataclasses.replace(NS, name_key=b"k" * 32)
    names = keyed.object_keys(hashes)
    assert names == keyed.object_keys(hashes)  # deterministic: lookups find writes
    assert len(set(names)) == 3 and names != plain
    for h, name in zip(hashes, names):
        assert h.hex() not in name and name.startswith(NS.tag + "-")
        assert len(name.rsplit("-", 1)[1]) == 64
    other = dataclasses.replace(NS, name_key=b"j" * 32).object_keys(hashes)
    assert not set(other) & set(names)
    assert "k" * 8 not in repr(keyed) and "name_key" not in repr(keyed)


def test_storage_config_derives_the_name_key_from_the_secret():
    from vllm_hicache.storage_config import parse_storage

    def cfg(**extra):
        return parse_storage({"hicache_storage_backend": "file",
                              "hicache_storage_backend_extra_config": extra})

    secret = "s" * 32
    assert cfg().object_name_key == b""
    key = cfg(storage_secret=secret).object_name_key
    assert len(key) == 32 and secret.encode() not in key
    assert key == cfg(storage_secret=secret).object_name_key
    assert key != cfg(storage_secret="t" * 32).object_name_key


# --- weight options: online quantization and hf_overrides (l3_identity) ------


def model_config(**fields) -> SimpleNamespace:
    return SimpleNamespace(model="org/model", revision=None, **fields)


def ns_of(config, **kwargs) -> KeyNamespace:
    """The namespace l3.setup.namespace builds for ``config``."""
    from tests.conftest import make_config
    from vllm_hicache.connector.geometry import KVGeometry
    from vllm_hicache.l3.setup import namespace

    vllm_config = SimpleNamespace(
        model_config=config,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1))
    geom = KVGeometry(block_size=16, layer_names=("l0",), bytes_per_block=0, num_l1_blocks=4,
                      num_kv_heads=2, head_size=8, is_mla=False, kv_dtype="bfloat16")
    return namespace(make_config(model_version="v1"), geom, vllm_config, 0, page_format="x",
                     **kwargs)


@pytest.mark.parametrize("a, b", [
    # --quantization fp8 of a bf16 checkpoint vs none.
    ({}, {"quantization": "fp8"}),
    ({"quantization": "fp8"}, {"quantization": "int8"}),
    # The same method with another per-layer config.
    ({"quantization": "fp8", "quantization_config": {"ignore": ["lm_head"]}},
     {"quantization": "fp8", "quantization_config": {"ignore": []}}),
    ({}, {"hf_overrides": {"rope_theta": 500000.0}}),
    ({"hf_overrides": {"rope_theta": 500000.0}}, {"hf_overrides": {"rope_theta": 1000000.0}}),
    ({"hf_overrides": {"text_config": {"num_layers": 2}}},
     {"hf_overrides": {"text_config": {"num_layers": 3}}}),
])
def test_quantization_and_hf_overrides_change_the_namespace(a, b):
    """Instances sharing a store (and a secret) that load the weights
    differently must never share keys."""
    first, second = ns_of(model_config(**a)), ns_of(model_config(**b))
    assert first.tag != second.tag
    assert first.object_keys([b"x"]) != second.object_keys([b"x"])


def test_equal_weight_options_give_equal_namespaces():
    from vllm.config.quantization import QuantizationConfigArgs

    one = model_config(quantization="fp8", quantization_config=QuantizationConfigArgs(
                           ignore=["lm_head"]),
                       hf_overrides={"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "f": 4}})
    two = model_config(quantization="fp8", quantization_config=QuantizationConfigArgs(
                           ignore=["lm_head"]),
                       hf_overrides={"rope_scaling": {"f": 4, "type": "yarn"}, "rope_theta": 1e6})
    assert ns_of(one).tag == ns_of(two).tag
    assert ns_of(one).quantization == (
        '{"config":{"ignore":["lm_head"],"linear":null,"moe":null,"targets":null},'
        '"method":"fp8"}')
    assert ns_of(one).hf_overrides == (
        '{"rope_scaling":{"f":4,"type":"yarn"},"rope_theta":1000000.0}')
    # Unset, vLLM's default (an empty dict) and absent are all "not at all".
    plain = [model_config(), model_config(quantization=None, hf_overrides={}),
             model_config(quantization=None, quantization_config=None, hf_overrides=None)]
    assert {(ns.quantization, ns.hf_overrides, ns.tag) for ns in map(ns_of, plain)} == {
        ("", "", ns_of(plain[0]).tag)}


def test_weight_options_that_are_not_plain_data_are_refused():
    with pytest.raises(ValueError, match=r"hf_overrides\.rope_scaling\.f .*type object is not"):
        ns_of(model_config(hf_overrides={"rope_scaling": {"f": object()}}))
    with pytest.raises(ValueError, match="hf_overrides in the L3 key namespace: its keys must"):
        ns_of(model_config(hf_overrides={1: "one"}))
    with pytest.raises(ValueError, match=r"quantization\.config"):
        ns_of(model_config(quantization="fp8", quantization_config={"x": float("nan")}))


def test_a_callable_hf_overrides_is_named_and_warned_about(caplog):
    def shorter(config):
        return config

    def longer(config):
        return config

    with caplog.at_level(logging.WARNING, "vllm_hicache.l3.identity"):
        named = ns_of(model_config(hf_overrides=shorter), log=True)
    assert "shorter" in named.hf_overrides and named.hf_overrides.startswith('{"callable":')
    assert "hf_overrides is a function" in caplog.text and "model_version" in caplog.text
    assert named.tag != ns_of(model_config(hf_overrides=longer)).tag
    assert named.tag == ns_of(model_config(hf_overrides=shorter)).tag
