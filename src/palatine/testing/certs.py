"""A throwaway PKI for testing the ``tls:`` transport.

`make_test_pki` writes a CA, a server certificate valid for ``127.0.0.1``, ``::1`` and
``localhost``, a client certificate, and — for negative tests — a second CA with a
client and a server certificate of its own. Keys are ECDSA P-256 (fast to generate) and
written with mode 0600. `tls_env` gives the ``PALATINE_TLS_*`` variables for a role.

Needs the ``cryptography`` package (``pip install 'palatine[test]'``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["make_node_pki", "TestPki", "make_test_pki", "tls_env"]

_ROLES = ("server", "client", "other_client", "other_server")


@dataclass(frozen=True, slots=True)
class TestPki:
    """Paths of the PEM files written by `make_test_pki`.

    ``other_*`` files are signed by ``other_ca``, which ``ca`` does not trust.
    """

    __test__ = False  # not a pytest test class, despite the name

    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    other_server_cert: Path
    other_server_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "palatine test"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=30))
    )


class _Ca:
    """A self-signed CA that can issue leaf certificates."""

    def __init__(self, common_name: str) -> None:
        self.key = _new_key()
        self.name = _name(common_name)
        self.cert = (
            _builder(common_name, self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue_node(self, ip: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A certificate for every process of one machine: it serves and it dials, so it
        carries both usages, and its names are the machine's address and loopback."""
        key = _new_key()
        sans: list[x509.GeneralName] = [
            x509.IPAddress(ipaddress.ip_address(ip)),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost"),
        ]
        cert = (
            _builder(f"palatine node {ip}", self.name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert, key

    def issue(
        self, common_name: str, *, server: bool
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A leaf certificate for a server (with SANs) or a client."""
        key = _new_key()
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            _builder(common_name, self.name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if server:
            sans: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)
    return path


def make_test_pki(directory: str | os.PathLike[str]) -> TestPki:
    """Write a CA, server and client certificates (plus an untrusted second CA's) into
    ``directory`` (created if missing) and return their paths."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    ca = _Ca("palatine test CA")
    other = _Ca("palatine other CA")
    server_cert, server_key = ca.issue("palatine test server", server=True)
    client_cert, client_key = ca.issue("palatine test client", server=False)
    o_client_cert, o_client_key = other.issue("palatine other client", server=False)
    o_server_cert, o_server_key = other.issue("palatine other server", server=True)
    return TestPki(
        directory=root,
        ca=_write_cert(root / "ca.pem", ca.cert),
        server_cert=_write_cert(root / "server.pem", server_cert),
        server_key=_write_key(root / "server.key", server_key),
        client_cert=_write_cert(root / "client.pem", client_cert),
        client_key=_write_key(root / "client.key", client_key),
        other_ca=_write_cert(root / "other-ca.pem", other.cert),
        other_client_cert=_write_cert(root / "other-client.pem", o_client_cert),
        other_client_key=_write_key(root / "other-client.key", o_client_key),
        other_server_cert=_write_cert(root / "other-server.pem", o_server_cert),
        other_server_key=_write_key(root / "other-server.key", o_server_key),
    )


def tls_env(pki: TestPki, role: str) -> dict[str, str]:
    """The ``PALATINE_TLS_CERT``/``_KEY``/``_CA`` variables for ``role``.

    ``server`` and ``client`` are trusted by each other. ``other_client`` and
    ``other_server`` present certificates from the untrusted CA (while trusting the
    good one), so their peers must refuse them.
    """
    pairs = {
        "server": (pki.server_cert, pki.server_key),
        "client": (pki.client_cert, pki.client_key),
        "other_client": (pki.other_client_cert, pki.other_client_key),
        "other_server": (pki.other_server_cert, pki.other_server_key),
    }
    if role not in pairs:
        raise ValueError(f"unknown TLS role {role!r}; expected one of {', '.join(_ROLES)}")
    cert, key = pairs[role]
    return {
        "PALATINE_TLS_CERT": str(cert),
        "PALATINE_TLS_KEY": str(key),
        "PALATINE_TLS_CA": str(pki.ca),
    }


def make_node_pki(
    directory: str | os.PathLike[str], ips: list[str], *, untrusted: tuple[str, ...] = ()
) -> dict[str, dict[str, str]]:
    """One CA and a certificate per machine address; the ``PALATINE_TLS_*`` variables of
    each address. An address in ``untrusted`` gets a certificate from another CA (which
    the rest do not trust), so its peers must refuse it."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    ca, other = _Ca("palatine cluster CA"), _Ca("palatine other CA")
    ca_path = _write_cert(root / "ca.pem", ca.cert)
    out = {}
    for ip in ips:
        cert, key = (other if ip in untrusted else ca).issue_node(ip)
        out[ip] = {
            "PALATINE_TLS_CERT": str(_write_cert(root / f"{ip}.pem", cert)),
            "PALATINE_TLS_KEY": str(_write_key(root / f"{ip}.key", key)),
            "PALATINE_TLS_CA": str(ca_path),
        }
    return out
