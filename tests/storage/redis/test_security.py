"""The redis backend's transport security against real redis-server processes
(loopback): an ACL user confined to our key prefix, a password read from a
file, and TLS (``rediss://``) with a private CA and client certificates,
generated here with ``cryptography``, against one server and a cluster."""

from __future__ import annotations

import datetime
import ipaddress
import time

import pytest

from tests.storage.conformance import empty, keys, make, obj, same
from tests.storage.ports import free_port
from tests.storage.redis.cluster_services import LocalCluster
from tests.storage.redis.services import RedisServer
from vllm_hicache.storage.redis.config import RedisConfig

pytestmark = pytest.mark.timeout(180)

ALICE_PW = "alice-pw-0123456789"


@pytest.fixture
def own_server(tmp_path):
    servers: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        servers.append(RedisServer(tmp_path / f"redis-{len(servers)}", *args).start())
        return servers[-1]

    yield start
    for srv in servers:
        srv.kill()


def round_trip(spec) -> None:
    b = make(spec)
    try:
        ks = keys(3)
        assert b.put(ks, [obj(i) for i in range(3)]) == [True] * 3
        assert b.exists_prefix(ks) == 3
        targets = [empty() for _ in ks]
        assert b.get(ks, targets) == [True] * 3
        assert all(same(t, obj(i)) for i, t in enumerate(targets))
        b.clear()
        assert b.exists_prefix(ks) == 0
    finally:
        b.close()


# --- ACL users and passwords ------------------------------------------------------


def test_acl_user_confined_to_its_prefix(own_server, tmp_path):
    srv = own_server("--user", "default", "off",
                     "--user", "alice", "on", f">{ALICE_PW}", "~acl:*", "+@all")
    url = f"redis://alice@127.0.0.1:{srv.port}/0"
    round_trip(("redis", {"url": url, "password": ALICE_PW, "key_prefix": "acl:"}))
    pw_file = tmp_path / "redis-password"
    pw_file.write_text(ALICE_PW + "\n")
    round_trip(("redis", {"url": url, "password": f"@{pw_file}", "key_prefix": "acl:"}))
    # Outside the user's key pattern the server says NOPERM: writes fail, reads miss.
    b = make(("redis", {"url": url, "password": ALICE_PW, "key_prefix": "other:"}))
    try:
        ks = keys(2)
        assert b.put(ks, [obj(0), obj(1)]) == [False, False]
        assert b.get(ks, [empty(), empty()]) == [False, False]
    finally:
        b.close()
    for options in ({"password": "wrong-pw-000"}, {}, {"url": srv.url, "password": ALICE_PW}):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="redis backend.*refused") as err:
            make(("redis", {"url": url, "key_prefix": "acl:", **options}))
        assert time.monotonic() - start < 5
        assert ALICE_PW not in str(err.value) and "wrong-pw" not in str(err.value)


def test_password_file_errors_name_the_file_only(tmp_path):
    with pytest.raises(ValueError, match="password: cannot read the file '/no/such'"):
        RedisConfig.from_options({"url": "redis://h", "password": "@/no/such"})
    empty_file = tmp_path / "empty"
    empty_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        RedisConfig.from_options({"url": "redis://h", "password": f"@{empty_file}"})
    pw = tmp_path / "pw"
    pw.write_text("s3cret-in-a-file\n")
    cfg = RedisConfig.from_options({"url": "redis://h", "password": f"@{pw}"})
    assert cfg.password == "s3cret-in-a-file" and "s3cret" not in repr(cfg)


# --- TLS -----------------------------------------------------------------------------


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(directory, name: str) -> dict[str, str]:
    """A CA and a server (SAN 127.0.0.1) and a client certificate it signed;
    PEM file paths by role."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def cert(subject, key, issuer, issuer_key, ca: bool, san=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca = cert(_name(f"{name} CA"), ca_key, _name(f"{name} CA"), ca_key, True)
    paths = {}

    def write(role: str, certificate, key=None) -> None:
        paths[f"{role}_cert"] = str(directory / f"{name}-{role}.crt")
        (directory / f"{name}-{role}.crt").write_bytes(
            certificate.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            paths[f"{role}_key"] = str(directory / f"{name}-{role}.key")
            (directory / f"{name}-{role}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))

    write("ca", ca)
    for role, san in (("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                  x509.DNSName("localhost")]), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(role, cert(_name(f"{name} {role}"), key, ca.subject, ca_key, False, san), key)
    return paths


@pytest.fixture
def tls_server(own_server, tmp_path):
    """A server with a TLS port (client certificates required) and a password;
    skipped, saying why, if this redis-server was built without TLS."""
    pki = make_pki(tmp_path, "good")
    tls_port = free_port()
    try:
        srv = own_server("--tls-port", str(tls_port), "--tls-cert-file", pki["server_cert"],
                         "--tls-key-file", pki["server_key"], "--tls-ca-cert-file",
                         pki["ca_cert"], "--tls-auth-clients", "yes", "--requirepass", ALICE_PW)
    except RuntimeError as err:
        if "tls" in str(err).lower():  # "Bad directive": built without BUILD_TLS=yes
            pytest.skip(f"this redis-server was built without TLS support: {err}")
        raise
    return srv, tls_port, pki


def test_tls_with_client_certificates(tls_server, tmp_path):
    srv, tls_port, pki = tls_server
    url = f"rediss://127.0.0.1:{tls_port}/0"
    tls = {"tls_ca_file": pki["ca_cert"], "tls_cert_file": pki["client_cert"],
           "tls_key_file": pki["client_key"]}
    round_trip(("redis", {"url": url, "password": ALICE_PW, **tls}))
    other = make_pki(tmp_path, "other")
    for bad in (
        {**tls, "tls_ca_file": other["ca_cert"]},  # a server we cannot verify
        {"tls_ca_file": pki["ca_cert"]},  # no client certificate
        {**tls, "tls_cert_file": other["client_cert"], "tls_key_file": other["client_key"]},
    ):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=f"redis backend.*{tls_port}"):
            make(("redis", {"url": url, "password": ALICE_PW, "startup_wait_s": 0.0, **bad}))
        assert time.monotonic() - start < 10
    # Plain TCP to the TLS port gets no answer it understands.
    with pytest.raises(ConnectionError, match="redis backend"):
        make(("redis", {"url": f"redis://127.0.0.1:{tls_port}/0", "password": ALICE_PW,
                        "startup_wait_s": 0.0, "socket_timeout_s": 1.0}))


def test_tls_cluster_every_node_verified(tmp_path):
    """A Redis Cluster over TLS: the seed's TLS files and client certificate
    reach every master the backend discovers (it only learns TLS ports)."""
    pki = make_pki(tmp_path, "cluster")
    try:
        cluster = LocalCluster(tmp_path / "cluster", tls=pki).start()
    except RuntimeError as err:
        if "tls" in str(err).lower():
            pytest.skip(f"this redis-server was built without TLS support: {err}")
        raise
    tls = {"tls_ca_file": pki["ca_cert"], "tls_cert_file": pki["client_cert"],
           "tls_key_file": pki["client_key"]}
    try:
        spec = ("redis", {"url": cluster.tls_seed_url, "cluster": True, **tls})
        round_trip(spec)
        b = make(spec)
        try:
            ks = keys(30)
            assert b.put(ks, [obj(i) for i in range(30)]) == [True] * 30
            assert len({cluster.master_of(b"hicache:" + k.encode()) for k in ks}) == 3
            targets = [empty() for _ in ks]
            assert b.get(ks, targets) == [True] * 30
            assert all(same(t, obj(i)) for i, t in enumerate(targets))
        finally:
            b.close()
        other = make_pki(tmp_path, "other")
        with pytest.raises(ConnectionError, match="redis backend: cannot reach any seed"):
            make(("redis", {"url": cluster.tls_seed_url, "cluster": True, "startup_wait_s": 0.0,
                            **tls, "tls_ca_file": other["ca_cert"]}))
    finally:
        cluster.kill()


@pytest.mark.parametrize("options, match", [
    ({"url": "redis://h", "tls_ca_file": "/etc/hostname"}, "tls_ca_file.*rediss://"),
    ({"url": "rediss://h", "tls_ca_file": "/no/such.pem"}, "tls_ca_file='/no/such.pem'"),
    ({"url": "rediss://h", "tls_cert_file": "/etc/hostname"}, "tls_cert_file and tls_key_file"),
    ({"url": "unix:///tmp/x.sock", "tls_key_file": "/etc/hostname"}, "rediss://"),
])
def test_tls_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        RedisConfig.from_options(options)
