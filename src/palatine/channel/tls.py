"""SSL contexts for the ``tls:`` transport: mutual TLS against one CA.

The server requires a client certificate (``CERT_REQUIRED``); the client verifies the
server certificate and its hostname or IP SAN; both trust only the configured CA, never
the system store. PEM files come from ``PALATINE_TLS_CERT``, ``PALATINE_TLS_KEY`` and
``PALATINE_TLS_CA``, read from the environment at call time so a launcher can point
each process at its own files. The token handshake still runs inside TLS.

Dialers pass the address's host as ``server_hostname``: an IP literal is matched
against the certificate's IP SANs, a name against its DNS SANs.
"""

from __future__ import annotations

import os
import ssl
from typing import Final, NamedTuple

from palatine.errors import ConfigError

__all__ = [
    "CA_ENV",
    "CERT_ENV",
    "KEY_ENV",
    "TlsFiles",
    "client_context",
    "server_context",
    "tls_files",
]

CERT_ENV: Final = "PALATINE_TLS_CERT"
KEY_ENV: Final = "PALATINE_TLS_KEY"
CA_ENV: Final = "PALATINE_TLS_CA"

_MISSING = "tls transport requires PALATINE_TLS_CERT, PALATINE_TLS_KEY and PALATINE_TLS_CA"


class TlsFiles(NamedTuple):
    """The three PEM files of this process: its certificate, its key, the trusted CA."""

    cert: str
    key: str
    ca: str


def tls_files() -> TlsFiles:
    """Read the three ``PALATINE_TLS_*`` variables; `ConfigError` unless all are set."""
    cert = os.environ.get(CERT_ENV, "")
    key = os.environ.get(KEY_ENV, "")
    ca = os.environ.get(CA_ENV, "")
    if not (cert and key and ca):
        raise ConfigError(_MISSING)
    return TlsFiles(cert, key, ca)


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> ssl.SSLContext:
    """Install our certificate chain and the CA; unreadable files name their variable."""
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=files.ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{CA_ENV}: cannot load CA certificates from {files.ca}: {exc}") from None
    try:
        ctx.load_cert_chain(certfile=files.cert, keyfile=files.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"{CERT_ENV}/{KEY_ENV}: cannot load certificate {files.cert} "
            f"with key {files.key}: {exc}"
        ) from None
    return ctx


def server_context() -> ssl.SSLContext:
    """A server-side context that demands a client certificate signed by the CA."""
    files = tls_files()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return _load(ctx, files)


def client_context() -> ssl.SSLContext:
    """A client-side context that verifies the server (CA and hostname/IP) and presents
    this process's certificate."""
    files = tls_files()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED + check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    return _load(ctx, files)
