"""KV cache events from a real vLLM CPU engine, over vLLM's own ZMQ
publisher (``kv_events_config``), read by a SUB socket on an ipc endpoint:
HiCache's L2 blocks (medium CPU) and L3 objects (medium STORAGE, the file
backend) appear next to vLLM's own (GPU), in the same hash space; L2
evictions are announced. In the same engine: a request with bad
``kv_transfer_params`` gets the reason in its output and the engine goes on."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    settle_backups,
)

pytestmark = pytest.mark.engine
TOPIC = b"hicache-test"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from vllm.config import KVEventsConfig

    tmp = tmp_path_factory.mktemp("events")
    endpoint = f"ipc://{tmp}/kv-events"
    extra = {
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": {"path": str(tmp / "l3")},
    }
    llm = make_llm(tiny_model_dir, extra, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
        topic=TOPIC.decode()))
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        time.sleep(0.5)  # PUB/SUB: subscribed before anything is published
        yield llm, sub
    finally:
        sub.close(linger=0)
        close(llm)


def drain(sub, quiet_s: float = 1.0) -> list:
    """Every event published until the publisher has been quiet a while."""
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events = []
    while sub.poll(int(quiet_s * 1000)):
        topic, _seq, payload = sub.recv_multipart()
        assert topic == TOPIC
        events.extend(decoder.decode(payload).events)
    return events


def of(events, kind: str, medium: str) -> list:
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def hashes(events) -> set:
    return {h for e in events for h in e.block_hashes}


def test_l2_and_l3_blocks_are_published_next_to_vllms(engine):
    llm, sub = engine
    prompts = prompts_with_shared_prefix()
    generate(llm, prompts)
    settle_backups(llm)
    events = drain(sub)
    gpu = of(events, "BlockStored", "GPU")
    cpu = of(events, "BlockStored", "CPU")
    l3 = of(events, "BlockStored", "STORAGE")
    full_blocks = [len(p) // BLOCK_SIZE for p in prompts]
    assert gpu and cpu and l3, {type(e).__name__ + ":" + str(e.medium) for e in events}
    # The same blocks, the same hashes: every block HiCache announces is one
    # vLLM computed and announced first.
    assert hashes(cpu) <= hashes(gpu)
    assert hashes(l3) == hashes(cpu)
    # 70 shared tokens = 2 shared blocks, then each prompt's own.
    assert len(hashes(cpu)) == 2 + sum(n - 2 for n in full_blocks)
    assert all(e.block_size == BLOCK_SIZE and e.token_ids for e in cpu)
    assert all(e.ownership == "file" for e in l3)
    assert not of(events, "BlockRemoved", "CPU")


def test_l2_evictions_are_published(engine):
    llm, sub = engine
    drain(sub, quiet_s=0.2)
    # L2 = 2 x 32 pages: 8 prompts of 12 blocks overflow it.
    flood = [[5 + (i * 7 + 31 * k) % 470 for i in range(12 * BLOCK_SIZE + 1)] for k in range(8)]
    for prompt in flood:
        generate(llm, [prompt], max_tokens=1)
    events = drain(sub)
    removed = of(events, "BlockRemoved", "CPU")
    assert removed
    assert len(hashes(removed)) >= 8 * 12 - 64


def test_bad_kv_transfer_params_are_answered_and_the_engine_goes_on(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, _ = engine
    bad = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                         extra_args={"kv_transfer_params": {"hicache_tiers": ["L4"]}})
    [out] = llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 80)))], bad,
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert "hicache_tiers" in out.kv_transfer_params["hicache_error"]
    outputs, _ = generate(llm, [list(range(3, 80))], max_tokens=4)
    assert outputs == [list(out.outputs[0].token_ids)]
