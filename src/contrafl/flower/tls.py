"""Self-signed TLS certificates for a local Flower deployment.

:func:`make_certificates` writes a throw-away certificate authority and a server
certificate signed by it, valid for ``localhost``, ``127.0.0.1`` and ``::1``: the SuperLink
gets the server certificate and key (``--ssl-certfile/--ssl-keyfile``, plus the CA as
``--ssl-ca-certfile``), SuperNodes and the ``flwr`` CLI trust the CA
(``--root-certificates`` / ``root-certificates``). They use the ``cryptography`` package,
which flwr depends on; nothing shells out to ``openssl``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Host names and addresses the server certificate is valid for.
SERVER_DNS_NAMES = ("localhost",)
SERVER_IP_ADDRESSES = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files written by :func:`make_certificates`."""

    ca_cert: Path
    """The CA certificate (``ca.crt``): what clients trust."""
    server_cert: Path
    """The server certificate signed by the CA (``server.pem``)."""
    server_key: Path
    """The server's private key (``server.key``, unencrypted, mode 0600)."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(folder: Path, *, valid_for: dt.timedelta = dt.timedelta(days=2)) -> TlsFiles:
    """Write a CA and a server certificate for ``localhost``/``127.0.0.1``/``::1`` into
    ``folder`` (created if needed; existing files are overwritten).

    Both certificates are valid from one hour before now (clock skew) until ``valid_for``
    after now. Keys are ECDSA P-256, signatures SHA-256. The CA key is not written: nothing
    else can ever be signed by this CA.
    """
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    not_before, not_after = now - dt.timedelta(hours=1), now + valid_for

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("contrafl local CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVER_DNS_NAMES]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in SERVER_IP_ADDRESSES]
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    files = TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.touch(mode=0o600)
    files.server_key.chmod(0o600)
    files.server_key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files
