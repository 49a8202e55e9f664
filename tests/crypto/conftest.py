"""Parties every crypto test signs and seals for."""

from __future__ import annotations

import pytest

from fedciuic.crypto.keys import Keypair


@pytest.fixture(scope="module")
def parties():
    return {
        "aggregator": Keypair.generate("aggregator", "EU"),
        "eu": Keypair.generate("eu", "EU"),
        "cn": Keypair.generate("cn", "CN", "ed25519+mldsa65"),
    }
