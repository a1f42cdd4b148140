"""The nixl L3 backend with NIXL's OBJ plugin against a local S3 server (moto).

moto_server runs on loopback for this module (services.py). Conformance,
then what S3 makes special: a truncated object (the probe byte), views of one
array, transfers past their deadline (an upload already sent may land late,
but whole and with the call's bytes; a late GET never reaches the caller's
buffers), clear by prefix, and start-up errors.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from tests.storage.conformance import OBJECT_BYTES, BackendConformance, empty, keys, make, obj, same
from tests.storage.nixl import services as services_nixl
from tests.storage.nixl.test_backend import (  # noqa: F401 - fixture
    built,
    late_transfers_leave_caller_buffers_alone,
    run_past_deadline,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = services_nixl.MotoServer(tmp_path_factory.mktemp("moto")).start()
    server.create_bucket("hicache-test")
    yield server
    server.stop()


def obj_spec(moto, **extra) -> tuple[str, dict]:
    return ("nixl", {"plugin": "OBJ", "bucket": "hicache-test", "endpoint_override": moto.endpoint,
                     "access_key": services_nixl.ACCESS_KEY,
                     "secret_key": services_nixl.SECRET_KEY,
                     "key_prefix": f"t-{uuid.uuid4().hex[:8]}/", **extra})


class TestNixlObjConformance(BackendConformance):
    @pytest.fixture
    def spec(self, moto):
        return obj_spec(moto)

    @pytest.fixture
    def backend(self, spec, built):
        return built(spec)


def test_obj_truncated_object_is_a_miss(moto, built):
    spec = obj_spec(moto)
    b = built(spec)
    ks = keys(2)
    assert b.put(ks, [obj(0), obj(1)]) == [True, True]
    prefix = spec[1]["key_prefix"]
    whole = np.concatenate(obj(0)).tobytes()
    moto.client().put_object(Bucket="hicache-test", Key=prefix + ks[0], Body=whole[:-1])
    targets = [empty(), empty()]
    assert b.get(ks, targets) == [False, True]
    assert same(targets[1], obj(1))


def test_obj_views_of_one_array_round_trip(moto, built):
    b = built(obj_spec(moto))
    ks = keys(2)
    flat = [np.concatenate(obj(i)) for i in range(2)]
    assert b.put(ks, [[f[:64], f[64:]] for f in flat]) == [True, True]
    out = np.zeros((2, OBJECT_BYTES), np.uint8)
    assert b.get(ks, [[o[:64], o[64:]] for o in out]) == [True, True]
    assert all(np.array_equal(o, f) for o, f in zip(out, flat))


def test_obj_late_transfers_never_touch_caller_buffers(moto, built):
    """A late GET lands in its staging slot only; a late PutObject uploads the
    bytes of the call, not the page the caller overwrote after put returned."""
    b = built(obj_spec(moto, timeout_s=0.3))
    fresh = late_transfers_leave_caller_buffers_alone(b)
    late = [empty(), empty()]
    got = b.get(fresh, late)
    assert all(same(t, obj(2 + i)) for i, t in enumerate(late) if got[i]), got


def test_obj_transfer_past_deadline_is_a_miss_within_the_bound(moto, built):
    fresh = run_past_deadline(built(obj_spec(moto, timeout_s=0.3)), 0.3)
    b = built(obj_spec(moto))
    # A PutObject already sent cannot be recalled: it may land late, but whole.
    late = [empty(), empty()]
    got = b.get(fresh, late)
    assert all(same(t, obj(2 + i)) for i, t in enumerate(late) if got[i])


def test_obj_clear_keeps_other_prefixes(moto, built):
    mine, other = built(obj_spec(moto)), built(obj_spec(moto))
    ks = keys(2)
    mine.put(ks, [obj(0), obj(1)])
    other.put(ks, [obj(0), obj(1)])
    mine.clear()
    assert mine.exists_prefix(ks) == 0 and other.exists_prefix(ks) == 2


def test_obj_unreachable_endpoint_at_start_is_a_clear_error():
    port = services_nixl.free_port()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"nixl backend.*127.0.0.1:{port}"):
        make(("nixl", {"plugin": "OBJ", "bucket": "b", "access_key": "k", "secret_key": "s",
                       "endpoint_override": f"http://127.0.0.1:{port}"}))
    assert time.monotonic() - start < 30


def test_obj_missing_bucket_is_a_clear_error(moto):
    with pytest.raises(ValueError, match="bucket 'no-such-bucket'"):
        make(obj_spec(moto, bucket="no-such-bucket"))
