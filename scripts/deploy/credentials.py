"""Credentials of a secure deployment, made with ``cryptography`` (a dependency of flwr).

- a throw-away CA, and a server certificate signed by it whose subjectAltName covers the addresses
  the SuperNodes, the CLI and the SuperLink's own SuperExec dial (127.0.0.1 and localhost);
- one SuperNode key pair per name: ECDSA on NIST P-384, the private key in OpenSSH format
  (``flower-supernode --auth-supernode-private-key`` reads it with ``load_ssh_private_key``), the
  public key as an OpenSSH line (``flwr supernode register`` reads it with ``load_ssh_public_key``).

Private keys are written with mode 0600. The CA's private key is never written: nothing else is
signed after start-up.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)
HOSTS = ("localhost",)
IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class TlsFiles:
    """The SuperLink's ``--ssl-ca-certfile``, ``--ssl-certfile`` and ``--ssl-keyfile``."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """A SuperNode's key pair: OpenSSH private key file, OpenSSH public key file."""

    private: Path
    public: Path

    def spki_base64(self) -> str:
        """The public key as base64 DER SubjectPublicKeyInfo: the body of the PEM block that the
        SuperLink prints when it refuses the key (``[ApiError:2004] ... public key: b'-----BEGIN
        PUBLIC KEY-----\\n...'``)."""
        key = serialization.load_ssh_public_key(self.public.read_bytes())
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return base64.b64encode(der).decode("ascii")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_tls(directory: Path) -> TlsFiles:
    """A fresh CA (``ca.crt``) and a server certificate for 127.0.0.1/localhost (``server.pem``,
    ``server.key``) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + VALIDITY
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("fl-rescaled deployment CA")).issuer_name(
            _name("fl-rescaled deployment CA")).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.DNSName(h) for h in HOSTS] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in IPS]
    server = (
        x509.CertificateBuilder().subject_name(_name(HOSTS[0])).issuer_name(ca.subject)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(directory / "ca.crt", directory / "server.pem", directory / "server.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_private(files.server_key, server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


def write_node_key(directory: Path, name: str) -> NodeKey:
    """A SuperNode key pair ``<name>`` (private) and ``<name>.pub`` (public) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    pair = NodeKey(directory / name, directory / f"{name}.pub")
    _write_private(pair.private, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    pair.public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b" " + name.encode() + b"\n")
    return pair
