"""Differential privacy for a region: the accounting and the persistent privacy
ledger (``ledger``), and DP-SGD with Opacus on the adapters (``dpsgd``)."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.privacy.budget import budget_status as budget_status
    from fedciuic.privacy.dpsgd import dp_count as dp_count
    from fedciuic.privacy.dpsgd import dp_mean as dp_mean
    from fedciuic.privacy.dpsgd import plan_private_steps as plan_private_steps
    from fedciuic.privacy.dpsgd import private_round as private_round
    from fedciuic.privacy.dpsgd import time_private_step as time_private_step
    from fedciuic.privacy.dpsgd import warn_once as warn_once
    from fedciuic.privacy.ledger import LEDGER_FILE as LEDGER_FILE
    from fedciuic.privacy.ledger import LedgerRound as LedgerRound
    from fedciuic.privacy.ledger import PrivacyError as PrivacyError
    from fedciuic.privacy.ledger import PrivacyLedger as PrivacyLedger
    from fedciuic.privacy.ledger import Step as Step
    from fedciuic.privacy.ledger import audit_witness as audit_witness
    from fedciuic.privacy.ledger import calibrate_noise as calibrate_noise
    from fedciuic.privacy.ledger import calibrate_noise_after as calibrate_noise_after
    from fedciuic.privacy.ledger import count_steps as count_steps
    from fedciuic.privacy.ledger import dp_mean_step as dp_mean_step
    from fedciuic.privacy.ledger import evaluations as evaluations
    from fedciuic.privacy.ledger import locked as locked
    from fedciuic.privacy.ledger import poisson_sample_rate as poisson_sample_rate
    from fedciuic.privacy.ledger import rebuild_ledger_command as rebuild_ledger_command
    from fedciuic.privacy.ledger import remembered_noise as remembered_noise
    from fedciuic.privacy.ledger import run_prefix as run_prefix

__getattr__ = face(__name__)  # each name imported on first use
