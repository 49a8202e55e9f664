"""Certificates and SuperNode keys in the formats flower-superlink and flwr accept."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedciuic.crypto.keys import KeyFileError
from fedciuic.crypto.tls import generate_server_tls, generate_supernode_key


def test_the_superlink_certificate_is_signed_by_the_ca_for_its_addresses(tmp_path):
    files = generate_server_tls(tmp_path, ["127.0.0.1", "superlink.example.org"])
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    assert "superlink.example.org" in names.get_values_for_type(x509.DNSName)
    for key in (files.server_key, tmp_path / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_supernode_keys_are_p384_in_openssh_format_and_never_overwritten(tmp_path):
    private, public = generate_supernode_key(tmp_path, "eu")
    key = serialization.load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    loaded = serialization.load_ssh_public_key(public.read_bytes())
    assert loaded.public_numbers() == key.public_key().public_numbers()  # type: ignore[union-attr]
    with pytest.raises(KeyFileError, match="already exists"):
        generate_supernode_key(tmp_path, "eu")
