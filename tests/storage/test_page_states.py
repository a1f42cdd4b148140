"""Objects of models with a state group (PageStore ``page_states``): each
says, under its check, whether its page's state part is valid; the flag
round-trips, cannot be flipped without the check failing, and a store that
expects no flags (or flags) never accepts the other kind."""

from __future__ import annotations

import pytest
import torch

from tests.storage.test_sealed_pages import HASHES, SECRET, make_pages  # noqa: F401
from vllm_hicache.storage.file.io import object_path
from vllm_hicache.storage.format import key_digest


def with_states(pages, on: bool = True):
    pages.page_states = on
    return pages


@pytest.mark.parametrize("secret", [None, SECRET])
def test_state_flags_round_trip(make_pages, secret):  # noqa: F811
    pages = with_states(make_pages(secret))
    assert pages.write(HASHES, [0, 1, 2, 3], [False, True, False, True]) == [True] * 4
    states: list[bool] = []
    assert pages.read(HASHES, [4, 5, 6, 7], states) == 4
    assert states == [False, True, False, True]
    assert torch.equal(pages.pool.read_pages([0, 1, 2, 3]), pages.pool.read_pages([4, 5, 6, 7]))
    # No states given: no page claims a valid state.
    fresh = [bytes([9 + i]) * 32 for i in range(2)]
    assert pages.write(fresh, [0, 1]) == [True, True]
    states = []
    assert pages.read(fresh, [4, 5], states) == 2 and states == [False, False]


@pytest.mark.parametrize("secret", [None, SECRET])
def test_flipping_the_flag_is_a_miss(make_pages, secret):  # noqa: F811
    """Whoever can write the store rewrites page 1's header to claim a valid
    state (the key digest the reader takes the flag from): the check, which
    covers that digest, fails, and the page is a miss."""
    pages = with_states(make_pages(secret))
    assert pages.write(HASHES[:2], [0, 1], [False, False]) == [True, True]
    key = pages.keys(HASHES[1:2])[0]
    path = object_path(pages.backend.root, key)
    with open(path, "r+b") as f:
        f.seek(16)
        f.write(key_digest(key + "#state"))
    states: list[bool] = []
    assert pages.read(HASHES[:2], [4, 5], states) == 1 and states == [False]
    assert pages.invalid_objects == 1


def test_flagged_and_plain_objects_are_never_mixed(make_pages):  # noqa: F811
    plain = make_pages()
    flagged = with_states(make_pages())
    assert plain.write(HASHES[:1], [0]) == [True]
    assert flagged.write(HASHES[1:2], [1], [True]) == [True]
    # Same object keys, so each finds the other's object, and refuses it.
    assert flagged.read(HASHES[:1], [4], []) == 0
    assert plain.read(HASHES[1:2], [5]) == 0
    assert flagged.invalid_objects == 1 and plain.invalid_objects == 1
