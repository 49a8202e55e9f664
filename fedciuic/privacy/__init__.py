"""Differential privacy for a region: the accounting and the persistent privacy
ledger (``ledger``), and DP-SGD with Opacus on the adapters (``dpsgd``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.privacy.budget import budget_status
    from fedciuic.privacy.dpsgd import (
        PrivateTrainer,
        plan_private_steps,
        private_round,
        time_private_step,
        warn_once,
    )
    from fedciuic.privacy.ledger import (
        LEDGER_FILE,
        BudgetExhausted,
        LedgerRound,
        PrivacyError,
        PrivacyLedger,
        RunBudgetExceeded,
        Step,
        audit_witness,
        calibrate_noise,
        epsilon_of,
        locked,
        poisson_sample_rate,
        rebuild_ledger_command,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "BudgetExhausted": "ledger",
    "LEDGER_FILE": "ledger",
    "LedgerRound": "ledger",
    "PrivacyError": "ledger",
    "PrivacyLedger": "ledger",
    "PrivateTrainer": "dpsgd",
    "RunBudgetExceeded": "ledger",
    "Step": "ledger",
    "audit_witness": "ledger",
    "budget_status": "budget",
    "calibrate_noise": "ledger",
    "epsilon_of": "ledger",
    "locked": "ledger",
    "plan_private_steps": "dpsgd",
    "poisson_sample_rate": "ledger",
    "private_round": "dpsgd",
    "rebuild_ledger_command": "ledger",
    "time_private_step": "dpsgd",
    "warn_once": "dpsgd",
}
__all__ = [
    "LEDGER_FILE",
    "BudgetExhausted",
    "LedgerRound",
    "PrivacyError",
    "PrivacyLedger",
    "PrivateTrainer",
    "RunBudgetExceeded",
    "Step",
    "audit_witness",
    "budget_status",
    "calibrate_noise",
    "epsilon_of",
    "locked",
    "plan_private_steps",
    "poisson_sample_rate",
    "private_round",
    "rebuild_ledger_command",
    "time_private_step",
    "warn_once",
]
__getattr__ = face(__name__, _WHERE)
