"""Certificates for a TLS SuperLink and keys for SuperNode authentication (``cryptography``).

A deployment needs a CA that every SuperNode (and ``flwr``) trusts (``--root-certificates``),
a SuperLink certificate from it for the names and addresses the SuperLink is reached at
and, with ``--enable-supernode-auth``, an EC P-384 key pair per SuperNode (OpenSSH format)
whose public half is registered with ``flwr supernode register``. Private keys are written
with mode 0600 and never overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedciuic.crypto.keys import write_private
from fedciuic.errors import ConfigError


@dataclass(frozen=True)
class ServerTls:
    """What ``flower-superlink`` needs for TLS, and what clients trust."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedciuic federation"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write_key(
    path: Path, key: ec.EllipticCurvePrivateKey, form: serialization.PrivateFormat
) -> None:
    pem = serialization.Encoding.PEM
    write_private(path, key.private_bytes(pem, form, serialization.NoEncryption()))


def generate_server_tls(out: Path, hosts: list[str], days: int = 365) -> ServerTls:
    """A CA and a SuperLink certificate for ``hosts`` (names or IP addresses)."""
    if not hosts:
        raise ConfigError(["--host: give at least one name or address the SuperLink is reached at"])
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _name("fedciuic federation CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    files = ServerTls(out / "ca.pem", out / "superlink.pem", out / "superlink.key")
    _write_key(out / "ca.key", ca_key, serialization.PrivateFormat.PKCS8)
    _write_key(files.server_key, server_key, serialization.PrivateFormat.PKCS8)
    files.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    files.server_cert.write_bytes(server_cert.public_bytes(pem))
    return files


def generate_supernode_key(out: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair for SuperNode authentication: NAME.auth.key (OpenSSH,
    0600) for ``--auth-supernode-private-key``, NAME.auth.pub for registration."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = out / f"{name}.auth.key", out / f"{name}.auth.pub"
    _write_key(private, key, serialization.PrivateFormat.OpenSSH)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + f" fedciuic-supernode-{name}\n".encode()
    )
    return private, public
