from vllm_hicache.scheduler.inflight import InflightLoads


def test_overlap_counts_concurrent_loads_of_a_hash():
    loads = InflightLoads()
    assert not loads.overlaps([b"a"])
    loads.start("r1", "lock1", [b"a", b"b"])
    loads.start("r2", "lock2", [b"b"])
    assert loads.overlaps([b"x", b"b"]) and len(loads) == 2
    assert loads.finish("r1") == "lock1"
    assert loads.overlaps([b"b"]) and not loads.overlaps([b"a"])
    assert loads.finish("r2") == "lock2"
    assert not loads.overlaps([b"b"]) and len(loads) == 0
    assert loads.finish("r2") is None  # unknown / already finished
