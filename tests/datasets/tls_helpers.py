"""TLS for the remote tests: self-signed and CA-signed certificates for 127.0.0.1, the tests'
shard server behind TLS, and the ``trust`` fixture (this process's SSL_CERT_FILE)."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mmproxy.apps.bench.remote import ShardServer

LOOPBACK = "127.0.0.1"


def certificate(folder: Path, name: str, *, ip: str = LOOPBACK, expired: bool = False):
    """A self-signed certificate for ``ip`` (an IP SAN) and its key, written as
    ``NAME.pem`` and ``NAME.key``; ``expired``: valid until an hour ago."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"mmproxy test {name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = ((now - datetime.timedelta(days=2), now - datetime.timedelta(hours=1))
                  if expired else (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)))
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    pem, private = folder / f"{name}.pem", folder / f"{name}.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return pem, private


def signed_certificate(folder: Path, name: str):
    """A CA (``certificate``'s) and a certificate for 127.0.0.1 that it signs, as a private CA's
    are (Rust's TLS takes no CA certificate as a server's own); returns the CA's PEM, the
    server's PEM and its key."""
    ca_pem, ca_private = certificate(folder, f"{name}-ca")
    ca = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_private.read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"mmproxy {name}")]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address(LOOPBACK))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    pem, private = folder / f"{name}.pem", folder / f"{name}.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return ca_pem, pem, private


@contextlib.contextmanager
def https_server(root: Path, pem: Path, private: Path):
    """The tests' shard server (:class:`ShardServer`) of ``root`` behind TLS with this
    certificate; yields its ``https://`` URL and the server (its request counts)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem, private)
    server = ShardServer(root)
    server._httpd.socket = context.wrap_socket(server._httpd.socket, server_side=True)
    with server:
        yield server.url.replace("http://", "https://", 1), server


@pytest.fixture
def trust(monkeypatch):
    """This process's TLS trust, as a test sets it: nothing of the machine's SSL_CERT_* or
    AWS_CA_BUNDLE; ``trust(pem)`` makes SSL_CERT_FILE that file."""
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)

    def use(pem: Path) -> None:
        monkeypatch.setenv("SSL_CERT_FILE", str(pem))

    return use
