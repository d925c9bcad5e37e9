"""TLS identities on disk and pinned channels against a real gRPC server on 127.0.0.1:0.

The server is grpc's own health service on two ports: one TLS with an identity made here, one
plaintext (what an aggregator from before TLS serves). The aggregator's own server is covered in
tests/gonka_node/aggregator/test_tls_transport.py.
"""

from __future__ import annotations

import hashlib
import socket
import stat
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gonka_node.core.tls import (
    CERT_FILE,
    KEY_FILE,
    SERVER_NAME,
    PeerCertificateError,
    PlaintextPeerError,
    TlsFileError,
    TlsIdentity,
    check_peer,
    create_identity,
    load_certificate,
    load_identity,
    load_or_create_identity,
    pinned_channel,
    server_credentials,
    split_target,
)

# ---------------------------------------------------------------------------------------------- files


def test_an_identity_is_made_once_with_a_private_key_and_reloads_to_the_same_certificate(tmp_path: Path) -> None:
    folder = tmp_path / "data" / "tls"
    made = load_or_create_identity(folder, ["agg.example.org", "10.1.2.3"])
    assert stat.S_IMODE((folder / KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    again = load_or_create_identity(folder, ["ignored.example.org"])
    assert again == made and again.sha256 == made.sha256
    cert = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
    assert made.sha256 == hashlib.sha256(cert.public_bytes(Encoding.DER)).digest()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [SERVER_NAME, "localhost", "agg.example.org"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert load_certificate(folder / CERT_FILE) == made.cert_pem
    assert sorted(p.name for p in tmp_path.joinpath("data").iterdir()) == ["tls"]  # no staging folder left


def test_repr_names_the_certificate_and_never_shows_the_key() -> None:
    identity = create_identity()
    key_body = b"".join(identity.key_pem.splitlines()[1:-1]).decode()
    assert repr(identity) == f"TlsIdentity(sha256={identity.sha256.hex()})"
    assert key_body[:16] not in repr(identity) and "PRIVATE" not in str(identity)


def _mismatched_key(folder: Path) -> None:
    (folder / KEY_FILE).write_bytes(create_identity().key_pem)


@pytest.mark.parametrize(
    ("damage", "named", "message"),
    [
        (_mismatched_key, KEY_FILE, "this key does not belong to"),
        (lambda f: (f / KEY_FILE).write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n"), KEY_FILE, "not an unencrypted PEM"),
        (lambda f: (f / CERT_FILE).write_bytes(b"garbage"), CERT_FILE, "not a PEM certificate"),
        (lambda f: (f / KEY_FILE).unlink(), KEY_FILE, "no such file, but cert.pem is there"),
        (lambda f: (f / CERT_FILE).unlink(), CERT_FILE, "no such file, but key.pem is there"),
        (lambda f: (f / KEY_FILE).chmod(0o640), KEY_FILE, "run `chmod 600"),
    ],
)
def test_a_damaged_identity_is_an_error_naming_the_file_and_is_never_replaced(
    tmp_path: Path, damage, named: str, message: str
) -> None:
    folder = tmp_path / "tls"
    load_or_create_identity(folder)
    damage(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(TlsFileError) as caught:
        load_or_create_identity(folder)
    assert str(caught.value).startswith(f"{folder / named}") and message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_identity_is_not_made_in_a_folder_holding_other_files(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "notes.txt").write_text("mine")
    with pytest.raises(TlsFileError, match="it must be a new or empty folder"):
        load_or_create_identity(tmp_path / "tls")
    assert [p.name for p in (tmp_path / "tls").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tls"]


def test_an_empty_folder_receives_the_identity(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir(mode=0o755)
    made = load_or_create_identity(tmp_path / "tls")
    assert load_identity(tmp_path / "tls") == made
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700


def test_targets_split_into_host_and_port() -> None:
    assert split_target("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_target("[::1]:7") == ("::1", 7)
    assert split_target("dns:///agg.example.org:443") == ("agg.example.org", 443)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        split_target("agg.example.org")


# ---------------------------------------------------------------------------------------------- wire


@dataclass
class Servers:
    identity: TlsIdentity
    tls: str
    plaintext: str


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    identity = create_identity()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    tls_port = server.add_secure_port("127.0.0.1:0", server_credentials(identity))
    plain_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield Servers(identity, f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain_port}")
    server.stop(0)


def health_check(channel: grpc.Channel) -> int:
    with channel:
        request = health_pb2.HealthCheckRequest(service="")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def test_a_pinned_client_talks_whatever_name_it_dials(servers: Servers) -> None:
    port = servers.tls.rsplit(":", 1)[1]
    for target in (servers.tls, f"localhost:{port}"):
        assert health_check(pinned_channel(target, servers.identity.cert_pem)) == 1  # SERVING
    check_peer(servers.tls, servers.identity.cert_pem)  # returns: the pin matches


def test_a_client_pinning_another_certificate_is_refused_and_told_why(servers: Servers) -> None:
    other = create_identity()
    with pytest.raises(grpc.RpcError) as caught:
        health_check(pinned_channel(servers.tls, other.cert_pem))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PeerCertificateError) as why:
        check_peer(servers.tls, other.cert_pem)
    assert str(why.value) == (
        f"the aggregator at {servers.tls} presents TLS certificate sha256 {servers.identity.sha256.hex()}, not "
        f"the pinned {other.sha256.hex()}: pin the certificate that aggregator publishes, or dial the right address"
    )


def test_plaintext_and_tls_do_not_mix(servers: Servers) -> None:
    with pytest.raises(grpc.RpcError) as plain_to_tls:
        health_check(grpc.insecure_channel(servers.tls))
    assert plain_to_tls.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as tls_to_plain:
        health_check(pinned_channel(servers.plaintext, servers.identity.cert_pem))
    assert tls_to_plain.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PlaintextPeerError, match=f"^{servers.plaintext} did not complete a TLS handshake"):
        check_peer(servers.plaintext, servers.identity.cert_pem)


def test_an_unreachable_server_is_an_os_error_not_a_pin_error(servers: Servers) -> None:
    with pytest.raises(ConnectionRefusedError):
        check_peer("127.0.0.1:1", servers.identity.cert_pem, timeout_s=5)
    # A proxy whose server is down accepts, then hangs up: an outage to wait out, not a wrong server.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        hang_up = threading.Thread(target=lambda: listener.accept()[0].close())
        hang_up.start()
        with pytest.raises(ConnectionError):  # reset or closed, depending on who is first: never a TlsError
            check_peer(f"127.0.0.1:{listener.getsockname()[1]}", servers.identity.cert_pem, timeout_s=5)
        hang_up.join(5)
