"""Self-signed TLS certificates for a Flower deployment.

:func:`make_certificates` writes a throw-away certificate authority and a server
certificate signed by it, valid for the host names and addresses the SuperNodes and the
``flwr`` CLI dial (by default ``localhost``, ``127.0.0.1`` and ``::1``, a deployment on
one machine): the SuperLink gets the server certificate and key
(``--ssl-certfile/--ssl-keyfile``, plus the CA as ``--ssl-ca-certfile``), SuperNodes and
the ``flwr`` CLI trust the CA (``--root-certificates`` / ``root-certificates``). They use
the ``cryptography`` package, which flwr depends on; nothing shells out to ``openssl``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import ConfigError

#: Host names and addresses the server certificate is valid for by default (one machine).
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_DNS_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


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


def alt_name(host: str) -> x509.GeneralName:
    """``host`` (an IPv4 or IPv6 address, or a DNS name) as a subject alternative name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not _DNS_NAME.fullmatch(host):
        raise ConfigError(
            f"server host {host!r} is neither an IP address nor a DNS name; give the name or "
            "address the SuperNodes dial to reach the SuperLink, e.g. server.example.org or 10.0.0.5"
        )
    return x509.DNSName(host)


def make_certificates(
    folder: Path, hosts: Sequence[str] = LOCAL_HOSTS, *, valid_for: dt.timedelta = dt.timedelta(days=2)
) -> TlsFiles:
    """Write a CA and a server certificate for ``hosts`` (the host names and IP addresses
    of the SuperLink that SuperNodes and the ``flwr`` CLI dial, and only those) into
    ``folder`` (created if needed; existing files are overwritten).

    Both certificates are valid from one hour before now (clock skew) until ``valid_for``
    after now. Keys are ECDSA P-256, signatures SHA-256. The CA key is not written: nothing
    else can ever be signed by this CA.
    """
    if not hosts:
        raise ConfigError("a server certificate needs at least one host name or address of the SuperLink")
    alt_names = [alt_name(h) for h in hosts]
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
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("contrafl SuperLink"))
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
