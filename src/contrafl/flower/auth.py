"""SuperNode authentication keys for a Flower deployment (flwr 1.41).

With ``flower-superlink --enable-supernode-auth`` (which needs TLS) the SuperLink accepts
only SuperNodes whose public key was registered with ``flwr supernode register KEY.pub``;
a SuperNode proves it holds the matching private key
(``flower-supernode --auth-supernode-private-key KEY``) on every request. A SuperNode
whose key is not registered cannot activate: it exits with flwr's code 305.

:func:`make_node_keys` writes one key pair per SuperNode in the formats flwr reads: the
private key in OpenSSH format (mode 0600; it stays on the SuperNode's machine) and the
public key as an OpenSSH line (what the SuperLink's operator registers). The keys are
ECDSA on NIST P-384, flwr's documented curve; ``ssh-keygen -t ecdsa -b 384 -N "" -f KEY``
makes equal ones. Like :mod:`contrafl.flower.tls`, this uses ``cryptography``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


@dataclass(frozen=True)
class NodeKey:
    """Paths of one SuperNode's key pair."""

    private: Path
    """The private key (``node-K``, OpenSSH format, mode 0600)."""
    public: Path
    """The public key (``node-K.pub``, one OpenSSH line)."""


def make_node_key(private: Path) -> NodeKey:
    """Write a new P-384 key pair: the private key to ``private`` and the public key to
    ``private`` + ``.pub`` (existing files are replaced)."""
    private.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    secret = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    private.unlink(missing_ok=True)
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    pub = private.with_name(private.name + ".pub")
    pub.write_bytes(public + b"\n")
    return NodeKey(private, pub)


def make_node_keys(folder: Path, count: int) -> list[NodeKey]:
    """Key pairs ``folder/node-K`` and ``folder/node-K.pub`` for SuperNodes ``K = 0 ..
    count - 1``."""
    return [make_node_key(Path(folder) / f"node-{k}") for k in range(count)]
