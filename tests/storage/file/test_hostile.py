"""The ``file`` backend against someone who can change its directory: a
re-pointed root symlink, symlinks planted in the fan-out or at the usage
file, FIFOs at an object's name, a hung I/O thread at close. Each test
stages the attack with real symlinks, FIFOs and permission bits and checks
that nothing is read or written outside the store and nothing hangs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.storage.conformance import empty, keys, make, obj, same
from tests.storage.file.fixtures import backend, build, root, spec  # noqa: F401
from tests.storage.test_sealed_pages import make_pages  # noqa: F401
from vllm_hicache.l3.canary import UNAVAILABLE, canary_hash, run_canary
from vllm_hicache.storage.file import beneath
from vllm_hicache.storage.file import io as file_io
from vllm_hicache.storage.file.capacity import USAGE_FILE

pytestmark = pytest.mark.timeout(120)


def openat2_works() -> bool:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        return beneath.available(fd)
    finally:
        os.close(fd)


@pytest.fixture(autouse=True, params=["openat2", "walk"])
def resolution(request, monkeypatch):
    """Every attack against both ways of reaching a file: one openat2 call
    where the kernel has it, the component walk elsewhere."""
    if request.param == "walk":
        monkeypatch.setattr(beneath, "available", lambda fd: False)
    elif not openat2_works():
        pytest.skip("this kernel or sandbox has no openat2")
    return request.param

# A hang shows as a thread still running after this long; an answer under
# load takes far less (the test names the time it measured).
HANG_S = 10.0


def all_files(path: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and not p.is_symlink()}


def swap_symlink(link: Path, target: Path) -> None:
    """Re-point ``link`` atomically, as an attacker owning it would."""
    new = link.with_name(link.name + ".new")
    new.symlink_to(target)
    os.replace(new, link)


def answered_within(fn, limit_s: float = HANG_S):
    """``fn()``'s result, failing the test if it has not returned after ``limit_s``."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(limit_s)
    assert out, f"no answer after {limit_s} s: hung"
    return out[0], time.monotonic() - start


# --- the root ---

def test_root_symlink_swapped_after_start_keeps_the_checked_directory(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(mode=0o700)
    theirs.mkdir()
    os.chmod(theirs, 0o777)  # a fresh start refuses this one
    link = tmp_path / "store"
    link.symlink_to(ours)
    b = make(("file", {"path": str(link), "max_bytes": 1 << 20}))
    try:
        ks = keys(3)
        assert b.put(ks[:1], [obj(0)]) == [True]
        swap_symlink(link, theirs)
        assert b.put(ks[1:], [obj(1), obj(2)]) == [True, True]
        target = empty()
        assert b.get(ks[2:], [target]) == [True] and same(target, obj(2))
        b.clear()
        assert b.exists_prefix(ks) == 0
        assert b.put(ks[:1], [obj(0)]) == [True]
    finally:
        b.close()
    assert list(theirs.iterdir()) == []
    assert len(list(ours.glob("*/*/*.hckv"))) == 1
    assert b.root == str(ours)  # what the logs name
    with pytest.raises(ValueError, match="writable by every user"):
        make(("file", {"path": str(link)}))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a symlink away")
def test_root_symlink_owned_by_another_user_is_refused(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "store"
    link.symlink_to(ours)
    os.lchown(link, 4242, 4242)
    with pytest.raises(ValueError, match=f"{link}.*symlink owned by uid 4242.*{ours}"):
        make(("file", {"path": str(link)}))
    make(("file", {"path": str(link), "allow_shared_dir": True})).close()


# --- symlinks planted inside ---

@pytest.mark.parametrize("depth", [1, 2])
def test_symlinked_fanout_directory_is_not_followed(tmp_path, backend, root, depth):
    """``aa`` (depth 1) or ``aa/bb`` (depth 2) of a key is a symlink to a
    directory outside holding a valid object under the key's name: no put
    lands there, and the object there is never read."""
    key = keys(1)[0]
    path = Path(file_io.object_path(str(root), key))
    top, leaf, name = path.parent.parent.name, path.parent.name, path.name
    outside = tmp_path / "outside"
    (outside / leaf).mkdir(parents=True)
    (outside / name).write_bytes(obj(7)[0].tobytes())
    (outside / leaf / name).write_bytes(obj(7)[0].tobytes())
    before = all_files(outside)
    if depth == 1:
        (root / top).symlink_to(outside)
    else:
        (root / top).mkdir(mode=0o700)
        (root / top / leaf).symlink_to(outside)
    assert backend.exists_prefix([key]) == 0
    assert backend.get([key], [empty()]) == [False]
    assert backend.put([key], [obj(1)]) == [False]
    backend.clear()
    assert all_files(outside) == before and sorted(outside.rglob("*")) == sorted(
        [outside / leaf, outside / name, outside / leaf / name])


def test_symlink_at_an_object_name_is_a_miss_and_replaced_by_a_put(tmp_path, backend, root):
    key = keys(1)[0]
    path = Path(file_io.object_path(str(root), key))
    path.parent.mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_bytes(obj(5)[0].tobytes())  # the right size: would load if followed
    path.symlink_to(secret)
    assert backend.exists_prefix([key]) == 0
    assert backend.get([key], [empty()]) == [False]
    assert backend.put([key], [obj(1)]) == [True]
    assert not path.is_symlink() and secret.read_bytes() == obj(5)[0].tobytes()


# --- the usage file ---

def test_usage_file_symlink_is_refused_at_start(tmp_path, root):
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious bytes, not a counter")
    (root / USAGE_FILE).symlink_to(victim)
    for options in ({}, {"max_bytes": 1 << 20}):
        with pytest.raises(ValueError, match=f"{root}/{USAGE_FILE}: it is a symlink"):
            make(("file", {"path": str(root), **options}))
    assert victim.read_bytes() == b"precious bytes, not a counter"


@pytest.mark.parametrize("plant", ["fifo", "hardlink"])
def test_usage_file_fifo_or_hard_link_is_refused_at_start(tmp_path, root, plant):
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 16)
    if plant == "fifo":
        os.mkfifo(root / USAGE_FILE)
    else:
        os.link(victim, root / USAGE_FILE)
    (err, elapsed) = answered_within(lambda: _start_error(root))
    assert "not a plain file with one link" in err and USAGE_FILE in err, (err, elapsed)
    assert victim.read_bytes() == b"x" * 16


def _start_error(root: Path) -> str:
    try:
        make(("file", {"path": str(root), "max_bytes": 1 << 20})).close()
    except ValueError as err:
        return str(err)
    return "started"


def test_usage_file_swapped_for_a_symlink_after_start_writes_only_the_store(tmp_path, build,
                                                                            root):
    """The counter is written through the descriptor opened at start: a
    symlink renamed over the name later leads nowhere, neither on a commit
    with max_bytes nor on clear."""
    b = build(max_bytes=1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious bytes, not a counter")
    planted = root / "planted"
    planted.symlink_to(victim)
    os.replace(planted, root / USAGE_FILE)
    assert b.put(keys(2), [obj(0), obj(1)]) == [True, True]
    b.clear()
    assert b.put(keys(1), [obj(0)]) == [True]
    assert victim.read_bytes() == b"precious bytes, not a counter"
    assert (root / USAGE_FILE).is_symlink()


# --- FIFOs and hung threads ---

@pytest.mark.parametrize("options", [{}, {"max_bytes": 1 << 20}, {"num_io_threads": 1}])
def test_fifo_at_an_object_name_is_a_miss_not_a_hang(build, root, options):
    b = build(**options)
    ks = keys(4)
    assert b.put(ks[:2], [obj(0), obj(1)]) == [True, True]
    fifo = Path(file_io.object_path(str(root), ks[1]))
    os.unlink(fifo)
    os.mkfifo(fifo)
    assert answered_within(lambda: b.exists_prefix(ks))[0] == 1
    targets = [empty() for _ in ks]
    hits, elapsed = answered_within(lambda: b.get(ks, targets))
    assert hits == [True, False, False, False], elapsed
    assert same(targets[0], obj(0))
    # A put renames its object over the FIFO; close does not wait on anything.
    assert answered_within(lambda: b.put(ks[1:2], [obj(1)]))[0] == [True]
    assert answered_within(lambda: b.get(ks[1:2], targets[1:2]))[0] == [True]
    os.unlink(fifo)
    os.mkfifo(fifo)
    answered_within(b.clear)
    assert not fifo.exists()  # clear removes what is named like an object
    answered_within(b.close)


def test_close_does_not_wait_for_a_hung_io_thread(build, monkeypatch):
    """A read stuck in the kernel (a dead mount) holds one I/O thread: close
    returns anyway, and the thread is a daemon that cannot block exit."""
    b = build(num_io_threads=2)
    ks = keys(2)
    assert b.put(ks, [obj(0), obj(1)]) == [True, True]
    stuck, release = threading.Event(), threading.Event()
    real_read = file_io.read_whole

    def hang_on_pool(*args):
        if threading.current_thread().name.startswith("hicache-file"):
            stuck.set()
            release.wait(60)
        return real_read(*args)

    monkeypatch.setattr(file_io, "read_whole", hang_on_pool)
    reader = threading.Thread(target=lambda: b.get(ks, [empty(), empty()]), daemon=True)
    reader.start()
    try:
        assert stuck.wait(HANG_S)
        hung = [t for t in threading.enumerate() if t.name.startswith("hicache-file")]
        assert hung and all(t.daemon for t in hung)
        _, elapsed = answered_within(b.close)
        assert elapsed < HANG_S
    finally:
        release.set()
        reader.join(HANG_S)


def test_start_canary_answers_when_its_object_becomes_a_fifo(tmp_path, make_pages,  # noqa: F811
                                                             monkeypatch):
    """Someone swaps the canary's object for a FIFO right after it is
    written: the canary reports the store unavailable instead of hanging
    the worker's start."""
    pages = make_pages()
    key = pages.keys([canary_hash(pages.ns)])[0]
    real_put = pages.backend.put

    def put_then_plant(keys, sources):
        stored = real_put(keys, sources)
        path = file_io.object_path(pages.backend.root, key)
        os.unlink(path)
        os.mkfifo(path)
        return stored

    monkeypatch.setattr(pages.backend, "put", put_then_plant)
    result, elapsed = answered_within(lambda: run_canary(pages))
    assert result.outcome == UNAVAILABLE and "not found" in result.detail, (result, elapsed)
