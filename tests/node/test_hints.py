"""A reader's slot hints (node/hints.py) through ``NodeTier.hold_pages``
without pins: pages found before skip the index while their seals hold; a
refilled page is asked of the index again; a drop anywhere (a refused page,
the admin API's clear) forgets every hint."""

from __future__ import annotations

import contextlib

import pytest

from tests.node.helpers import insert, make, page_of


@contextlib.contextmanager
def two_members(root: str, slots: int = 4):
    with make(root, slots=slots) as writer, make(root, slots=slots) as reader:
        reader.pinless_reads = True
        yield writer, reader


def index_finds(tier, monkeypatch) -> list:
    calls: list = []
    find = tier._index.find
    monkeypatch.setattr(tier._index, "find", lambda keys, db=None: calls.append(
        list(keys)) or find(keys, db))
    return calls


def test_pages_found_before_skip_the_index(node_root, monkeypatch):
    with two_members(node_root) as (writer, reader):
        insert(writer, [b"a", b"b"])
        finds = index_finds(reader, monkeypatch)
        assert [p.key for p in reader.hold_pages([b"a", b"b", b"c"])] == [b"a", b"b"]
        assert finds == [[b"a", b"b", b"c"]]
        assert [p.key for p in reader.hold_pages([b"a", b"b", b"c"])] == [b"a", b"b"]
        assert finds[1:] == [[b"c"]]  # only the key it never found


def test_a_refilled_slot_is_asked_of_the_index_again(node_root, monkeypatch):
    with two_members(node_root, slots=2) as (writer, reader):
        insert(writer, [b"a", b"b"])
        (old_a, _) = reader.hold_pages([b"a", b"b"])
        assert insert(writer, [b"c"]) == [b"a"]  # a's slot now holds c
        insert(writer, [b"a"])                   # and a is back, elsewhere
        finds = index_finds(reader, monkeypatch)
        (new_a,) = reader.hold_pages([b"a"])
        assert finds == [[b"a"]] and new_a != old_a
        assert reader.seals_held([new_a]) == 1
        start = reader.geometry.data_offset + new_a.slot * reader.geometry.slot_stride
        assert bytes(reader.mapping()[start:start + 16]) == page_of(b"a")[:16]


@pytest.mark.parametrize("how", ["clear", "refused"])
def test_a_drop_anywhere_forgets_every_hint(node_root, how):
    """An evicted page nobody refilled still reads as its key's bytes; a
    dropped one must not be read again, even though its seal is intact."""
    with two_members(node_root) as (writer, reader):
        insert(writer, [b"a", b"b"])
        assert len(reader.hold_pages([b"a", b"b"])) == 2
        if how == "clear":
            assert writer.clear() == 2
            assert reader.hold_pages([b"a"]) == []
        else:
            (b,) = writer.hold_pages([b"b"])
            writer.drop_page(b, "refused by the test")
            assert [p.key for p in reader.hold_pages([b"a", b"b"])] == [b"a"]


def test_hints_are_bounded_by_the_tier_s_slots(node_root):
    with two_members(node_root, slots=2) as (writer, reader):
        for keys in ([b"a", b"b"], [b"c", b"d"], [b"e", b"f"]):
            insert(writer, keys)
            assert len(reader.hold_pages(keys)) == 2
        assert len(reader._hints) == 2
