"""A full NIXL POSIX store: the object directory is a tiny tmpfs, mounted in a
private mount namespace of a child process (root only). Writes that do not
fit are skipped (False); what was stored still reads back byte-exact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

needs_root_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounting a tmpfs in a private mount namespace needs root and unshare",
)


@needs_root_unshare
def test_full_store_skips_writes_and_keeps_reads_exact(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = textwrap.dedent(f"""
        from tests.storage.conformance import empty, keys, make, obj, same
        b = make(("nixl", {{"path": {str(mnt)!r}}}))
        ks = keys(60)  # 60 x ~4 KiB into a 128 KiB file system
        ok = b.put(ks, [obj(i) for i in range(60)])
        stored = [i for i, good in enumerate(ok) if good]
        assert 0 < len(stored) < 60, ok
        targets = [empty() for _ in stored]
        got = b.get([ks[i] for i in stored], targets)
        assert all(got), got
        assert all(same(t, obj(i)) for t, i in zip(targets, stored))
        b.close()
        print("ok", len(stored))
    """)
    # mode=0700: the store refuses a directory others can write (tmpfs defaults to 1777).
    mount = f"mount -t tmpfs -o size=128k,mode=0700 tmpfs {mnt}"
    cmd = ["unshare", "-m", "sh", "-c", f"{mount} && exec {sys.executable} -c \"$0\"", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0 and "ok" in out.stdout, (out.stdout[-2000:], out.stderr[-3000:])
