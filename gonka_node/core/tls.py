"""TLS identities and credentials: every gRPC service is TLS-only, and clients pin one certificate.

There is no certificate authority. An aggregator's self-signed certificate is its own trust anchor:
a client trusts exactly the certificate it pinned (gRPC `root_certificates` = that PEM) and checks it
under one fixed name, `SERVER_NAME` (`grpc.ssl_target_name_override`), so the host:port it dials does
not matter (an aggregator may sit behind any address, NAT or TCP proxy). The pin comes from a file
today; the aggregator's account will publish the certificate's PEM and sha256 on chain.

An identity lives in a folder of its own: `cert.pem` (public) and `key.pem` (ECDSA P-256, PKCS#8,
mode 0600). Both are staged in a private temporary folder that is renamed into place, so a crash
leaves both files or neither. A folder holding one file without the other, an unreadable file, or a
key that does not belong to the certificate is an error naming the file: an identity clients may
have pinned is never replaced silently. The private key never appears in a repr, log or message.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import shutil
import socket
import ssl
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from training.durable import fsync_path, write_new_file

SERVER_NAME = "gonka-aggregator"  # the name every certificate carries and every client checks
DEFAULT_NAMES = (SERVER_NAME, "localhost", "127.0.0.1")
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
MAX_PEM_BYTES = 64 * 1024
# The pin, not the validity period, is what clients trust; rotation is an explicit new announcement.
# RFC 5280 §4.1.2.5: 99991231235959Z means "no well-defined expiration date".
NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)
CLOCK_SLACK = datetime.timedelta(days=1)  # a client whose clock is behind still accepts a new certificate


class TlsError(Exception):
    """A TLS identity, pin or peer problem; the message names the file or address and what to do."""


class TlsFileError(TlsError):
    """A certificate or key file is missing, unreadable, malformed, too open, or not a matching pair."""


class PeerCertificateError(TlsError):
    """The server completed a TLS handshake with a certificate other than the pinned one."""


class PlaintextPeerError(TlsError):
    """The server did not complete a TLS handshake (a plaintext server, or not a gRPC server at all)."""


@dataclass(frozen=True, repr=False)
class TlsIdentity:
    """A certificate and its private key, both PEM. `sha256` names the certificate (of its DER bytes)."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @property
    def sha256(self) -> bytes:
        return certificate_sha256(self.cert_pem)

    def __repr__(self) -> str:
        return f"TlsIdentity(sha256={self.sha256.hex()})"


# ---------------------------------------------------------------------------------------------- create


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def create_identity(names: Sequence[str] = ()) -> TlsIdentity:
    """A new self-signed P-256 certificate for `SERVER_NAME`, localhost, 127.0.0.1 and `names`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    alt_names = [_general_name(n) for n in dict.fromkeys((*DEFAULT_NAMES, *names))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SLACK)
        .not_valid_after(NOT_AFTER)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        # Not a CA: the pin trusts this one certificate, never others its key could sign.
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsIdentity(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def load_or_create_identity(folder: Path, names: Sequence[str] = ()) -> TlsIdentity:
    """The identity in `folder`, created there (with `names`) when neither file exists yet.

    `names` only matter at creation: clients check `SERVER_NAME`, never the dialled host.
    """
    if not (folder / CERT_FILE).exists() and not (folder / KEY_FILE).exists():
        identity = create_identity(names)
        _save(folder, identity)
        return identity
    return load_identity(folder)


def _save(folder: Path, identity: TlsIdentity) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))  # mode 0700
    try:
        write_new_file(staging / KEY_FILE, identity.key_pem, 0o600)
        write_new_file(staging / CERT_FILE, identity.cert_pem, 0o644)
        os.rename(staging, folder)  # both files or neither; refused if `folder` holds anything
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise TlsFileError(
            f"{folder}: cannot create a TLS identity there ({exc.strerror}); it must be a new or empty folder"
        ) from None
    fsync_path(folder.parent)  # the rename itself survives a crash


# ---------------------------------------------------------------------------------------------- load


def load_identity(folder: Path) -> TlsIdentity:
    """Read and check `folder`'s pair: the key must be private (0600) and belong to the certificate."""
    cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
    cert = _parse_certificate(cert_path, _read(cert_path, private=False))
    key_pem = _read(key_path, private=True)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise TlsFileError(f"{key_path}: not an unencrypted PEM private key") from None  # no excerpt
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise TlsFileError(
            f"{key_path}: this key does not belong to {cert_path}; restore the matching pair "
            f"(deleting both creates a new identity, which every client must pin anew)"
        )
    return TlsIdentity(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def load_certificate(path: Path) -> bytes:
    """The PEM of the certificate in `path` (a pin: the aggregator's `cert.pem`)."""
    return _parse_certificate(path, _read(path, private=False)).public_bytes(serialization.Encoding.PEM)


def certificate_sha256(cert_pem: bytes) -> bytes:
    """sha256 of the certificate's DER bytes: what the chain will publish next to the PEM."""
    return hashlib.sha256(x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)).digest()


def _public_der(public_key: Any) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _parse_certificate(path: Path, pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise TlsFileError(f"{path}: not a PEM certificate (expected the aggregator's {CERT_FILE})") from None


def _read(path: Path, *, private: bool) -> bytes:
    partner = CERT_FILE if path.name == KEY_FILE else KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        hint = f", but {partner} is there: restore it, or delete both" if (path.parent / partner).exists() else ""
        raise TlsFileError(f"{path}: no such file{hint}") from None
    except OSError as exc:
        raise TlsFileError(f"{path}: cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file actually opened
        if not stat.S_ISREG(st.st_mode):
            raise TlsFileError(f"{path} is not a regular file")
        if private and st.st_mode & 0o077:
            raise TlsFileError(
                f"{path} is accessible to group/others (mode {stat.S_IMODE(st.st_mode):04o}); run "
                f"`chmod 600 {path}` if nobody else could have read it, else delete both files for a new identity"
            )
        data = f.read(MAX_PEM_BYTES + 1)
    if len(data) > MAX_PEM_BYTES:
        raise TlsFileError(f"{path}: larger than {MAX_PEM_BYTES} bytes, not a PEM file")
    return data


# ---------------------------------------------------------------------------------------------- gRPC


def server_credentials(identity: TlsIdentity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(identity.key_pem, identity.cert_pem)])


def pinned_channel(target: str, cert_pem: bytes, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to `target` that trusts exactly `cert_pem`, checked under `SERVER_NAME`."""
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    return grpc.secure_channel(
        target, credentials, options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)]
    )


# ---------------------------------------------------------------------------------------------- peers


def presented_certificate(target: str, timeout_s: float) -> bytes:
    """The DER certificate the TLS server at `target` (host:port) presents, unverified: the caller
    compares it with its pin. OSError when unreachable or closed at once; PlaintextPeerError when it
    answers, but not with TLS."""
    host, port = split_target(target)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we only read the certificate, to say what is wrong
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout_s) as sock:
        try:
            with context.wrap_socket(sock, server_hostname=SERVER_NAME) as tls:
                der = tls.getpeercert(binary_form=True)
        except ssl.SSLEOFError:
            # Closed without a word: what a proxy in front of a stopped server does. An outage, not a
            # wrong server: a daemon should wait it out.
            raise ConnectionAbortedError(f"{target} closed the connection during the TLS handshake") from None
        except ssl.SSLError as exc:
            raise PlaintextPeerError(
                f"{target} did not complete a TLS handshake ({exc.reason or exc}): it is not a TLS "
                f"aggregator (a plaintext server, or another service on that port)"
            ) from None
    if der is None:
        raise PlaintextPeerError(f"{target} completed a TLS handshake without a certificate")
    return der


def check_peer(target: str, cert_pem: bytes, timeout_s: float = 10.0) -> None:
    """Raise PeerCertificateError unless the server at `target` presents exactly `cert_pem`."""
    seen = hashlib.sha256(presented_certificate(target, timeout_s)).digest()
    pinned = certificate_sha256(cert_pem)
    if seen != pinned:
        raise PeerCertificateError(
            f"the aggregator at {target} presents TLS certificate sha256 {seen.hex()}, not the pinned "
            f"{pinned.hex()}: pin the certificate that aggregator publishes, or dial the right address"
        )


def split_target(target: str) -> tuple[str, int]:
    """(host, port) of a `host:port` or `[v6]:port` gRPC target (with an optional `dns:///`)."""
    rest = target.removeprefix("dns:///")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{target!r}: expected HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)
