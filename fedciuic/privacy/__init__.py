"""Differential privacy for a region: the accounting and the persistent privacy
ledger (``ledger``), and DP-SGD with Opacus on the adapters (``dpsgd``)."""

from __future__ import annotations

from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.privacy.ledger import (
    BudgetExhausted,
    PrivacyError,
    PrivacyLedger,
    calibrate_noise,
    epsilon_of,
)

__all__ = [
    "BudgetExhausted",
    "PrivacyError",
    "PrivacyLedger",
    "PrivateTrainer",
    "calibrate_noise",
    "epsilon_of",
]
