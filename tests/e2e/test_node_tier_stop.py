"""A ``vllm-hicache serve`` instance on the node tier, stopped gracefully as
Docker or Kubernetes stop it (SIGTERM to the API server, with
``--shutdown-timeout``): by the time the server has exited, its processes
(EngineCore's scheduler half and the worker) have left the tier through the
connector's shutdown path: no member row, pin, reservation or lease file of
theirs is left for a sweep, and the pages they published stay.

(With vLLM's default ``--shutdown-timeout 0`` vLLM kills EngineCore and its
worker with SIGKILL right after the SIGTERM, so they cannot leave: they are
reclaimed like a killed instance's, tests/e2e/test_node_tier_serve.py.)

One server start; it listens on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.test_node_tier_serve import Tier, _group_pids, _node_argv
from tests.e2e.test_serve import BLOCK, Server
from tests.ports import free_ports

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

SHUTDOWN_TIMEOUT_S = 10
EXIT_TIMEOUT_S = 120.0


def test_a_gracefully_stopped_instance_leaves_the_node_tier(tiny_model_dir, tmp_path):
    root = tmp_path / "tier"
    root.mkdir()
    argv = _node_argv(tiny_model_dir, root, None) + [
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    [port] = free_ports(1)
    server = Server("stop", argv, tmp_path / "stop.log", "nobind", port)
    server.start()
    try:
        server.wait_ready()
        server.complete([5 + (i * 13) % 470 for i in range(3 * BLOCK + 5)])
        tier = Tier(root)
        pids = _group_pids(server.proc.pid)
        members = tier.members_of(pids)
        assert len(members) >= 2, "the scheduler half and the worker joined the tier"
        tier.wait_sealed(3, "the prompt's blocks")
        sealed = tier.sealed()
        os.kill(server.proc.pid, signal.SIGTERM)  # the API server only
        assert server.proc.wait(EXIT_TIMEOUT_S) == 0, server.log_tail()
        deadline = time.monotonic() + 30  # its EngineCore and worker exit with it
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        # No survivor and no joiner swept: these rows are gone because they left.
        assert tier.members_of_ids(members) == [], server.log_tail()
        assert tier.held_by(members) == 0
        assert os.listdir(next(root.glob("hicache-node-*")) / "members") == []
        assert tier.sealed() == sealed  # its pages stay for the others
    finally:
        server.stop()
