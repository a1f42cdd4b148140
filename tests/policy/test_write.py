import pytest

from vllm_hicache.policy.write import HitCounter, WritePolicy


def test_write_through_stores_everything():
    policy = WritePolicy("write_through", 8)
    assert policy.stores_on_compute
    assert policy.should_store(b"a")


def test_selective_needs_two_uses():
    policy = WritePolicy("write_through_selective", 8)
    policy.record_use([b"a", b"b"])
    assert not policy.should_store(b"a")
    policy.record_use([b"a"])
    assert policy.should_store(b"a")
    assert not policy.should_store(b"b")
    policy.clear()
    assert not policy.should_store(b"a")


def test_write_back_never_stores_on_compute():
    policy = WritePolicy("write_back", 8)
    assert not policy.stores_on_compute
    assert not policy.should_store(b"a")


def test_unknown_policy():
    with pytest.raises(ValueError, match="write_around"):
        WritePolicy("write_around", 8)


def test_hit_counter_is_bounded_lru():
    counter = HitCounter(capacity=2)
    counter.record([b"a", b"b"])
    counter.record([b"a"])  # a is now most recent
    counter.record([b"c"])  # evicts b
    assert len(counter) == 2
    assert counter.count(b"b") == 0
    assert counter.count(b"a") == 2


@pytest.mark.parametrize("name", ["write_through", "write_through_selective", "write_back"])
def test_select_agrees_with_should_store(name):
    policy = WritePolicy(name, 8)
    hashes = [b"a", b"b", b"c", b"d"]
    policy.record_use(hashes[:3])
    policy.record_use(hashes[1:2])
    expected = [i for i in (0, 1, 3) if policy.should_store(hashes[i])]
    assert policy.select(hashes, [0, 1, 3]) == expected
    assert expected == {"write_through": [0, 1, 3], "write_through_selective": [1],
                        "write_back": []}[name]
