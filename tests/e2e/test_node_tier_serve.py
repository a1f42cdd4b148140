"""Three ``vllm-hicache serve`` instances sharing one node tier, in rotation,
and one of them killed with SIGKILL mid-stream.

Servers (started together, once per run): ``reference`` (no connector) and
``n0``, ``n1``, ``n2``: HiCache with the same ``node_tier_name``, the tier in
the test's tmp directory (not /dev/shm, which CI may not have), no L3 behind
it (run ``node``) or a ``file`` L3 (run ``node+file``, only with
``HICACHE_SOAK=1``: it starts every server again, doubling the time).

    reference  every prompt below, answered by the reference first
    rotation   two conversations of three turns; turn k of conversation c
               goes to instance (c + k) mod 3, so each instance sees each
               conversation once and the earlier turns it is sent can only
               come from the node tier: the delta of its
               ``vllm:hicache_hit_tokens_total{tier="L3"}`` around the
               request (requests to one instance are sequential) must cover
               them. Before a turn moves on, the previous turn's pages are
               waited for in the tier's index (a user's think time).
    kill       a client thread streams to n0 and n1 while n2, in the middle
               of a streamed answer, gets SIGKILL on its whole process group
               (API server and EngineCore): no failed request, the reference's
               answers; n2's member rows, reservations and pins leave the
               index and the ``vllm:hicache_node_tier_members`` gauge of a
               survivor drops by n2's share, within a bounded wait.
    restart    n2 again on the same tier: its first requests (each
               conversation's fourth turn) hit the node tier.
    dp         (run ``node``) one server with ``--data-parallel-size 2``, on a
               tier of its own, started beside the restart: each
               conversation's first turn goes to DP rank c mod 2 (vLLM's
               ``X-data-parallel-rank`` header), its second to the other rank,
               which finds the first turn in the node tier (its engine's
               L3 hit counter, and the answer's cached tokens).

Every loop is bounded in count and time; servers listen on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.test_serve import (
    BLOCK,
    CLI,
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    TEST_ARGS,
    Server,
    _cores,
    _no_proxy_opener,
    metric_value,
)
from tests.ports import free_ports
from vllm_hicache.node.index import Index

# Four server starts at once, then a restart, on 2 cores shared with other work.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

SOAK = os.getenv("HICACHE_SOAK") == "1"
START_TIMEOUT_S = 900.0
NODE_TIER_BYTES = 16 << 20  # about 500 pages of the tiny model: nothing is evicted
TIER_NAME = "rotation"
INSTANCES = 3
CONVERSATIONS = 2
TURNS = 3  # in rotation; a fourth goes to the restarted instance
FIRST_TURN_TOKENS = 70
TURN_TOKENS = 40
STREAM_PROMPTS = [[9 + (i * (k + 5) * 23 + 13 * k) % 470 for i in range(3 * BLOCK + 5)]
                  for k in range(4)]
VICTIM_PROMPT = [11 + (i * 19 + 7) % 470 for i in range(2 * BLOCK + 9)]
# Long enough to be killed in the middle of it: on a fast machine the tiny
# model streamed all of 256 before the SIGKILL landed. The prompt (73 tokens)
# and this stay within the servers' --max-model-len 512.
VICTIM_MAX_TOKENS = 432
MAX_STREAM_REQUESTS = 300
ANSWERS_AFTER_RECLAIM = 4
DP_SIZE = 2
DP_TIER_NAME = TIER_NAME + "-dp"
PAGES_WAIT_S = 60.0
RECLAIM_WAIT_S = 30.0
STABLE_S = 1.0
POLL_S = 0.2


def _user_tokens(conversation: int, turn: int) -> list[int]:
    n = FIRST_TURN_TOKENS if turn == 0 else TURN_TOKENS
    step = 7 + 3 * conversation + turn
    return [5 + (i * step * 29 + 53 * conversation + 11 * turn) % 470 for i in range(n)]


def _node_argv(model_dir: Path, root: Path, l3_dir: Path | None,
               name: str = TIER_NAME) -> list[str]:
    extra: dict = {
        "hicache_ratio": 2.0, "hicache_write_policy": "write_through",
        "node_tier_bytes": NODE_TIER_BYTES, "node_tier_name": name,
        "node_tier_root": str(root),
        # A turn's first request waits for its node-tier hit.
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"prefetch_threshold": BLOCK},
    }
    if l3_dir is not None:
        extra["hicache_storage_backend"] = "file"
        extra["hicache_storage_backend_extra_config"]["path"] = str(l3_dir)
    config = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return [str(CLI), "serve", str(model_dir), "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps(config)] + TEST_ARGS


def _full_blocks(prompt: list[int]) -> int:
    return len(prompt) // BLOCK


class Tier:
    """The node tier's index, read from the test (a reader: it joins nothing)."""

    def __init__(self, root: Path, name: str = TIER_NAME) -> None:
        found = sorted(root.glob(f"hicache-node-{name}-*/index.sqlite"))
        assert len(found) == 1, f"expected one tier under {root}: {found}"
        self.index = Index(str(found[0]), lock_timeout_s=10.0)

    def sealed(self) -> int:
        return self.index.counts()["sealed"]

    def wait_sealed(self, at_least: int, what: str) -> None:
        """Until ``at_least`` pages are sealed and the count stays put for
        ``STABLE_S`` (a page of the last turn may still be on its way)."""
        deadline = time.monotonic() + PAGES_WAIT_S
        last, since = -1, time.monotonic()
        for _ in range(int(PAGES_WAIT_S / POLL_S) + 1):
            now = time.monotonic()
            count = self.sealed()
            if count != last:
                last, since = count, now
            elif count >= at_least and now - since >= STABLE_S:
                return
            if now > deadline:
                break
            time.sleep(POLL_S)
        pytest.fail(f"{what}: {last} pages sealed in the node tier after {PAGES_WAIT_S:.0f} s, "
                    f"expected at least {at_least}")

    def members_of(self, pids: set[int]) -> list[str]:
        return [m.member for m in self.index.members() if m.pid in pids]

    def members_of_ids(self, ids: list[str]) -> list[str]:
        """Which of ``ids`` are still members."""
        return [m.member for m in self.index.members() if m.member in ids]

    def held_by(self, members: list[str]) -> int:
        """Reservations and pins that ``members`` still hold."""
        if not members:
            return 0
        marks = ",".join("?" * len(members))
        with self.index.read() as db:
            reserved = db.execute(f"SELECT COUNT(*) FROM slots WHERE state = 1 AND owner IN "
                                  f"({marks})", members).fetchone()[0]
            pinned = db.execute(f"SELECT COUNT(*) FROM pins WHERE member IN ({marks})",
                                members).fetchone()[0]
        return reserved + pinned


def _group_pids(pgid: int) -> set[int]:
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
            pids.add(int(pid))
    return pids


def _l3_hit_tokens(server: Server, **engine: str) -> float:
    return metric_value(server.metrics_text(), "vllm:hicache_hit_tokens_total", tier="L3",
                        **engine)


@dataclass
class Turn:
    conversation: int
    turn: int
    instance: str
    prompt: list[int]
    answer: list[int]
    expected: list[int]
    cached: int
    l3_tokens: float  # the delta of the instance's L3 hit counter around the request


class Stream(threading.Thread):
    """Requests to the survivors in turn until ``done`` (bounded in count)."""

    def __init__(self, servers: list[Server], expected: list[list[int]]) -> None:
        super().__init__(daemon=True, name="survivor-stream")
        self.servers, self.expected = servers, expected
        self.done = threading.Event()
        self.answers: list[tuple[int, list[int]]] = []  # (prompt index, token ids)
        self.errors: list[str] = []

    def run(self) -> None:
        for n in range(MAX_STREAM_REQUESTS):
            if self.done.is_set():
                return
            k = n % len(STREAM_PROMPTS)
            try:
                out = self.servers[n % len(self.servers)].complete(STREAM_PROMPTS[k])
            except BaseException as err:  # noqa: BLE001 - pytest.fail raises Failed
                self.errors.append(repr(err))
                return
            self.answers.append((k, out["token_ids"]))

    def wait_answers(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < count and not self.errors and self.is_alive():
            if time.monotonic() > deadline:
                pytest.fail(f"the stream answered {len(self.answers)} of {count} requests "
                            f"in {timeout_s:.0f} s")
            time.sleep(POLL_S)


def _kill_mid_stream(server: Server) -> int:
    """Start a streamed completion on ``server``, SIGKILL its process group
    after the first chunk; the number of chunks it had sent."""
    body = json.dumps({"model": "tiny", "prompt": VICTIM_PROMPT, "max_tokens": VICTIM_MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    chunks = 0
    resp = _no_proxy_opener().open(req, timeout=120)
    try:
        for line in resp:
            if line.startswith(b"data: {"):
                chunks += 1
                break
        os.killpg(server.proc.pid, signal.SIGKILL)
        try:
            for line in resp:  # the rest, until the connection drops
                chunks += line.startswith(b"data: {")
        except (OSError, http.client.HTTPException):  # the connection dropped
            pass
    finally:
        resp.close()
    return chunks


@dataclass
class Rotation:
    turns: list[Turn]
    resumed: list[Turn]
    dp_turns: list[Turn]  # [] in the run with a file L3
    stream: Stream
    victim_chunks: int
    members_before: float
    members_after: float
    used_bytes_before: float
    used_bytes_after: float
    victim_members: list[str]
    victim_members_left: list[str]
    victim_held_left: int
    problems: list[str]
    l3_dir: Path | None
    logs: dict[str, str] = field(default_factory=dict)


def _reference_answers(reference: Server) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Each conversation's prompts (TURNS + 1 turns) built from the reference's
    answers, and those answers."""
    prompts: list[list[list[int]]] = []
    answers: list[list[list[int]]] = []
    for c in range(CONVERSATIONS):
        history: list[int] = []
        prompts.append([])
        answers.append([])
        for k in range(TURNS + 1):
            prompt = history + _user_tokens(c, k)
            answer = reference.complete(prompt)["token_ids"]
            prompts[c].append(prompt)
            answers[c].append(answer)
            history = prompt + answer
    return prompts, answers


def _send(server: Server, c: int, k: int, prompt: list[int], expected: list[int]) -> Turn:
    before = _l3_hit_tokens(server)
    out = server.complete(prompt)
    return Turn(c, k, server.name, prompt, out["token_ids"], expected, out["cached"],
                _l3_hit_tokens(server) - before)


def _send_to_rank(server: Server, rank: int, c: int, k: int, prompt: list[int],
                  expected: list[int]) -> Turn:
    """A completion on DP rank ``rank`` of ``server``, as a router sends it."""
    before = _l3_hit_tokens(server, engine=str(rank))
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
    try:
        with _no_proxy_opener().open(req, timeout=REQUEST_TIMEOUT_S) as resp:
            out = json.loads(resp.read())
    except (OSError, ValueError) as err:
        pytest.fail(f"DP rank {rank}: completion failed: {err!r}\n{server.log_tail()}")
    return Turn(c, k, f"dp{rank}", prompt, out["choices"][0]["token_ids"], expected,
                out["usage"]["prompt_tokens_details"]["cached_tokens"],
                _l3_hit_tokens(server, engine=str(rank)) - before)


def _dp_rotation(server: Server, root: Path, prompts: list[list[list[int]]],
                 answers: list[list[list[int]]]) -> list[Turn]:
    tier = Tier(root, DP_TIER_NAME)
    base, blocks_done, turns = tier.sealed(), 0, []
    for c in range(CONVERSATIONS):
        for k in range(DP_SIZE):
            rank = (c + k) % DP_SIZE
            turns.append(_send_to_rank(server, rank, c, k, prompts[c][k], answers[c][k]))
            tier.wait_sealed(base + blocks_done + _full_blocks(prompts[c][k]),
                             f"DP: conversation {c} turn {k} on rank {rank}")
        blocks_done += _full_blocks(prompts[c][DP_SIZE - 1])
    tier.index.close()
    return turns


@pytest.fixture(scope="module", params=[
    "node",
    pytest.param("node+file", marks=pytest.mark.skipif(
        not SOAK, reason="starts every server again: HICACHE_SOAK=1 (make soak)")),
])
def rotation(request, tiny_model_dir, tmp_path_factory) -> Rotation:
    if not CLI.exists():
        pytest.fail(f"{CLI} is missing: run `pip install -e . --no-deps` (or `make setup`)")
    tmp = tmp_path_factory.mktemp("node-rotation")
    root = tmp / "tier"
    root.mkdir()
    l3_dir = tmp / "l3" if request.param == "node+file" else None
    argv = _node_argv(tiny_model_dir, root, l3_dir)
    cores = _cores()
    ports = free_ports(INSTANCES + 3)
    reference = Server("reference", [str(CLI), "serve", str(tiny_model_dir),
                                     "--enable-prefix-caching"] + TEST_ARGS,
                       tmp / "reference.log", cores[0], ports[0])
    nodes = [Server(f"n{i}", argv, tmp / f"n{i}.log", cores[(i + 1) % 2], ports[i + 1])
             for i in range(INSTANCES)]
    again = Server("n2-again", argv, tmp / "n2-again.log", nodes[2].core, ports[-2])
    # Each DP rank is an engine of its own: no one core for the server.
    dp = Server("dp", _node_argv(tiny_model_dir, root, None, DP_TIER_NAME)
                + ["--data-parallel-size", str(DP_SIZE)], tmp / "dp.log", "nobind", ports[-1])
    dp_run = request.param == "node"
    survivors, victim = nodes[:2], nodes[2]
    everyone = [reference, *nodes, again, dp]
    stream = Stream(survivors, [])
    try:
        for server in (reference, *nodes):
            server.start()
        for server in (reference, *nodes):
            server.wait_ready(START_TIMEOUT_S)
        prompts, answers = _reference_answers(reference)
        stream.expected = [reference.complete(p)["token_ids"] for p in STREAM_PROMPTS]
        reference.stop()

        tier = Tier(root)
        base = tier.sealed()  # the start canaries', if they leave any
        turns: list[Turn] = []
        blocks_done = 0  # full blocks of the conversations already finished
        for c in range(CONVERSATIONS):
            for k in range(TURNS):
                server = nodes[(c + k) % INSTANCES]
                turns.append(_send(server, c, k, prompts[c][k], answers[c][k]))
                tier.wait_sealed(base + blocks_done + _full_blocks(prompts[c][k]),
                                 f"conversation {c} turn {k} on {server.name}")
            blocks_done += _full_blocks(prompts[c][TURNS - 1])

        victim_members = tier.members_of(_group_pids(victim.proc.pid))
        members_before = survivors[0].metric("vllm:hicache_node_tier_members")
        used_bytes_before = survivors[0].metric("vllm:hicache_node_tier_used_bytes")
        stream.start()
        stream.wait_answers(2, 120)
        victim_chunks = _kill_mid_stream(victim)
        victim.proc.wait(timeout=30)
        victim.proc = None
        # A survivor's sweep drops n2's members; its gauge shows it at its next step.
        want = members_before * (INSTANCES - 1) / INSTANCES
        deadline = time.monotonic() + RECLAIM_WAIT_S
        members_after = members_before
        while time.monotonic() < deadline and not stream.errors:
            members_after = survivors[0].metric("vllm:hicache_node_tier_members")
            reclaimed = not tier.members_of_ids(victim_members)
            if members_after == want and reclaimed:
                break
            if reclaimed:
                # The gauge moves at the survivor's next step; on busy cores
                # the stream may leave it idle for seconds (seen in CI: the
                # tier had 4 members at +15 s, the idle gauge said 5 at +30 s).
                survivors[0].complete(STREAM_PROMPTS[0])
            time.sleep(POLL_S)
        stream.wait_answers(len(stream.answers) + ANSWERS_AFTER_RECLAIM, 120)
        used_bytes_after = survivors[0].metric("vllm:hicache_node_tier_used_bytes")
        stream.done.set()
        stream.join(timeout=120)

        again.start()
        if dp_run:
            dp.start()
        again.wait_ready(START_TIMEOUT_S)
        resumed = [_send(again, c, TURNS, prompts[c][TURNS], answers[c][TURNS])
                   for c in range(CONVERSATIONS)]
        dp_turns: list[Turn] = []
        if dp_run:
            dp.wait_ready(START_TIMEOUT_S)
            dp_turns = _dp_rotation(dp, root, prompts, answers)
        counts = tier.index.counts()
        out = Rotation(
            turns=turns, resumed=resumed, dp_turns=dp_turns, stream=stream,
            victim_chunks=victim_chunks,
            members_before=members_before, members_after=members_after,
            used_bytes_before=used_bytes_before, used_bytes_after=used_bytes_after,
            victim_members=victim_members,
            victim_members_left=tier.members_of_ids(victim_members),
            victim_held_left=tier.held_by(victim_members),
            problems=tier.index.problems(counts["rows"]), l3_dir=l3_dir,
            logs={s.name: s.log() for s in everyone if s.log_path.exists()})
        tier.index.close()
    finally:
        stream.done.set()
        for server in everyone:
            server.stop()
    return out


def test_every_answer_equals_the_reference(rotation):
    for turn in rotation.turns + rotation.resumed:
        assert turn.answer == turn.expected, (turn.conversation, turn.turn, turn.instance)
        assert len(turn.answer) == MAX_TOKENS


def test_earlier_turns_are_node_tier_hits_on_another_instance(rotation):
    """From turn 2 on, the instance never saw the conversation: the earlier
    turns' full blocks are L3 hits (the node tier's, or the file L3 behind
    it), counted on that instance for that request."""
    later = [t for t in rotation.turns if t.turn > 0]
    assert {t.instance for t in later} == {f"n{i}" for i in range(INSTANCES)}
    for turn in rotation.turns:
        if turn.turn == 0:
            assert turn.l3_tokens == 0, turn.instance
            continue
        earlier = rotation.turns[rotation.turns.index(turn) - 1].prompt
        floor = _full_blocks(earlier) * BLOCK
        assert turn.cached >= floor, (turn.conversation, turn.turn, turn.instance)
        assert turn.l3_tokens >= floor, (turn.conversation, turn.turn,
                                         rotation.logs[turn.instance][-3000:])


def test_kill_mid_stream_fails_no_request_on_the_others(rotation):
    stream = rotation.stream
    assert rotation.victim_chunks >= 1  # killed while it was answering
    assert rotation.victim_chunks < VICTIM_MAX_TOKENS
    assert not stream.errors, stream.errors
    assert len(stream.answers) >= 2 + ANSWERS_AFTER_RECLAIM
    for k, answer in stream.answers:
        assert answer == stream.expected[k], k


def test_the_killed_instance_is_reclaimed(rotation):
    assert rotation.victim_members, "n2 had no member in the node tier before the kill"
    assert rotation.members_before >= INSTANCES
    assert rotation.members_after == rotation.members_before * (INSTANCES - 1) / INSTANCES
    assert rotation.victim_members_left == []
    # What it had published stays for the others (the tier evicts nothing here).
    assert rotation.used_bytes_after >= rotation.used_bytes_before > 0
    assert rotation.victim_held_left == 0
    assert rotation.problems == []


def test_the_restarted_instance_hits_the_node_tier(rotation):
    for turn in rotation.resumed:
        earlier = [t for t in rotation.turns if t.conversation == turn.conversation][-1].prompt
        floor = _full_blocks(earlier) * BLOCK
        assert turn.cached >= floor, rotation.logs["n2-again"][-3000:]
        assert turn.l3_tokens >= floor
    assert "Traceback" not in rotation.logs["n2-again"], rotation.logs["n2-again"][-3000:]


def test_data_parallel_ranks_share_the_tier(rotation):
    if not rotation.dp_turns:
        pytest.skip("data parallelism runs with the node tier alone (run `node`)")
    for turn in rotation.dp_turns:
        assert turn.answer == turn.expected, (turn.conversation, turn.turn, turn.instance)
        if turn.turn == 0:
            assert turn.l3_tokens == 0, turn.instance
            continue
        earlier = rotation.dp_turns[rotation.dp_turns.index(turn) - 1].prompt
        floor = _full_blocks(earlier) * BLOCK
        assert turn.cached >= floor, (turn.conversation, turn.instance, rotation.logs["dp"][-3000:])
        assert turn.l3_tokens >= floor, (turn.conversation, turn.instance)


def test_the_file_l3_behind_the_tier_got_the_pages(rotation):
    if rotation.l3_dir is None:
        pytest.skip("the node tier alone in this run")
    assert len(list(rotation.l3_dir.rglob("*.hckv"))) >= _full_blocks(rotation.turns[-1].prompt)
