"""Sealing and opening one L3 object's page in memory, with and without the
storage secret: the primitive under every L3 backend's read and write path.

The codecs and their set-up are benchmarks/bench_l3_seal.py's (which also
times the whole file-backend path against the raw engine):

    checksum   xxh3-128, no secret configured
    gmac       AES-256-GMAC, ``storage_secret``
    aead       AES-256-GCM, ``storage_encrypt``

at a page of 64 KiB (one layer of a small model) and 1 MiB (16 layers).
``open`` checks the object sealed in the set-up, so a codec that stopped
verifying would fail here rather than look fast.
"""

from __future__ import annotations

import pytest
from bench_l3_seal import codec_calls

CODECS = ("checksum", "gmac", "aead")
PAGE_SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20}

pytestmark = pytest.mark.benchmark(group="seal")


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("op", ["seal", "open"])
def test_codec(benchmark, op: str, codec: str, page: str) -> None:
    size = PAGE_SIZES[page]
    seal, open_ = codec_calls(codec, size)
    benchmark(seal if op == "seal" else open_)
    benchmark.extra_info["gbps"] = size / benchmark.stats.stats.median / 1e9
