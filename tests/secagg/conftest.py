"""The regions' identity keys, made once for the secure-aggregation tests."""

from __future__ import annotations

import pytest

from fedciuic.crypto import Keypair

NAMES = ("at", "br", "cn", "de", "eu", "fr", "gb", "us")


@pytest.fixture(scope="session")
def keys() -> dict[str, Keypair]:
    return {n: Keypair.generate(n, "EU") for n in NAMES}
