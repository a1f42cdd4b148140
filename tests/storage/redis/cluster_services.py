"""A local Redis Cluster for the tests: three masters, three replicas.

Six redis-server processes (services.RedisServer: loopback, no persistence,
private work directories) with ``--cluster-enabled yes``, joined by
``redis-cli --cluster create ... --cluster-replicas 1``. Client and cluster
bus ports both come from tests/ports.py (``--cluster-port``: the default bus
port, client port + 10000, could land in the kernel's ephemeral range). A
short ``cluster-node-timeout`` makes a failover take seconds, not the
default 15 s plus an election. With ``tls`` (make_pki's file paths) each node
also has a TLS port (client certificates required), the cluster bus and
replication run over TLS, and the nodes announce their TLS ports to TLS
clients; the plain ports stay for the tests' own clients. Every wait is
bounded.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from tests.ports import free_ports
from tests.storage.redis.services import RedisServer

NODES = 6
# A master is declared failed after this long without answering; its
# replica then wins an election within about a second more. Long enough that
# a master paused for a second (a hung node, not a dead one) keeps its slots.
NODE_TIMEOUT_MS = 2000
_CREATE_TIMEOUT_S = 60.0
_WAIT_STEP_S = 0.1


class LocalCluster:
    """Three masters and three replicas on 127.0.0.1."""

    def __init__(self, workdir: Path, *extra_args: str, password: str | None = None,
                 tls: dict[str, str] | None = None) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install -y redis-tools; "
                               "the redis-server package depends on it)")
        self.cli = cli
        self.password = password
        # Replicas authenticate to their masters with the same password.
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        ports = free_ports(3 * NODES)
        self.tls_ports = ports[2 * NODES:] if tls else []
        self.cli_args = ["-a", password, "--no-auth-warning"] if password else []
        if tls:
            self.cli_args += ["--tls", "--cacert", tls["ca_cert"], "--cert", tls["client_cert"],
                              "--key", tls["client_key"]]
        self.servers = [
            RedisServer(
                workdir / f"node-{i}", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-port", str(ports[NODES + i]),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), *auth,
                *(_tls_args(tls, self.tls_ports[i]) if tls else ()), *extra_args, port=ports[i],
            )
            for i in range(NODES)
        ]

    def start(self) -> LocalCluster:
        try:
            for srv in self.servers:
                srv.start()
            ports = self.tls_ports or [srv.port for srv in self.servers]
            addresses = [f"127.0.0.1:{port}" for port in ports]
            done = subprocess.run(
                [self.cli, *self.cli_args, "--cluster", "create", *addresses,
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=_CREATE_TIMEOUT_S,
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout[-3000:]}"
                                   f"\n{done.stderr[-2000:]}")
            self.wait_healthy(_CREATE_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        return self

    @property
    def seed_url(self) -> str:
        return self.servers[0].url

    @property
    def tls_seed_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_ports[0]}/0"

    def node(self, port: int) -> RedisServer:
        return next(srv for srv in self.servers if srv.port == port)

    def client(self, port: int):
        """A plain (not cluster-aware) client of the node on ``port``."""
        return self.node(port).client(password=self.password)

    def live(self) -> list[RedisServer]:
        return [srv for srv in self.servers if srv.proc is not None and srv.proc.poll() is None]

    def masters(self) -> list[int]:
        """Ports of the masters that serve slots, as a live node sees them."""
        return sorted({int(master[1]) for _first, _last, master, *_ in self._slots()})

    def master_of(self, key: bytes) -> int:
        """The port of the master serving ``key``'s slot."""
        client = self.client(self.live()[0].port)
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        finally:
            client.close()
        for first, last, master, *_replicas in self._slots():
            if first <= slot <= last:
                return int(master[1])
        raise RuntimeError(f"no master serves slot {slot}")

    def _slots(self) -> list:
        client = self.client(self.live()[0].port)
        try:
            return client.execute_command("CLUSTER", "SLOTS")
        finally:
            client.close()

    def wait_healthy(self, timeout_s: float) -> None:
        """Until every live node reports ``cluster_state:ok``, all 16384 slots
        served and three masters each with a connected replica (bounded)."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            last = self._health()
            if last == "":
                return
            time.sleep(_WAIT_STEP_S)
        raise RuntimeError(f"the cluster did not become healthy in {timeout_s:g} s: {last}")

    def _health(self) -> str:
        """"" when healthy, else what is not."""
        try:
            for srv in self.live():
                text = self._info(srv.port).decode()
                if "cluster_state:ok" not in text or "cluster_slots_ok:16384" not in text:
                    return f"node {srv.port}: {text.splitlines()[:3]}"
            slots = self._slots()
        except Exception as err:  # a node still starting or failing over
            return f"{type(err).__name__}: {err}"
        masters = {int(m[1]) for _s, _e, m, *_r in slots}
        with_replica = {int(m[1]) for _s, _e, m, *r in slots if r}
        if len(masters) != 3 or with_replica != masters:
            return f"masters {sorted(masters)}, with a replica {sorted(with_replica)}"
        return ""

    def kill_master(self, port: int) -> list[int]:
        """SIGKILL the master on ``port`` (an outage: no shutdown, no
        handover); the masters before, for wait_promoted."""
        before = self.masters()
        assert port in before, f"{port} is not a master"
        self.node(port).kill()
        return before

    def wait_promoted(self, before: list[int], timeout_s: float) -> int:
        """Until the live nodes agree that a replica replaced the killed
        master and the cluster is ok again; the new master's port (bounded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                masters = set(self.masters())
                states_ok = all(b"cluster_state:ok" in self._info(srv.port)
                                for srv in self.live())
            except Exception:  # a node busy with the election
                masters, states_ok = set(), False
            promoted = masters - set(before)
            if states_ok and len(masters) == 3 and promoted:
                return promoted.pop()
            time.sleep(_WAIT_STEP_S)
        raise RuntimeError(f"no replica took over in {timeout_s:g} s (masters before: {before})")

    def _info(self, port: int) -> bytes:
        client = self.client(port)
        try:
            return client.execute_command("CLUSTER", "INFO")
        finally:
            client.close()

    def kill(self) -> None:
        for srv in self.servers:
            srv.kill()


def _tls_args(pki: dict[str, str], tls_port: int) -> list[str]:
    return ["--tls-port", str(tls_port), "--tls-cert-file", pki["server_cert"],
            "--tls-key-file", pki["server_key"], "--tls-ca-cert-file", pki["ca_cert"],
            "--tls-auth-clients", "yes", "--tls-cluster", "yes", "--tls-replication", "yes"]
