"""What a region's dataset has spent against its lifetime budget, read from its ledger.

``fedciuic budget`` and ``fedciuic simulate`` show it before a run starts, so that a run
whose target no longer fits is seen on the launching machine, not as declined rounds.
Reading changes nothing: the ledger is parsed and checked as a round would open it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fedciuic.config import Accountant, PrivacyUnit
from fedciuic.privacy.ledger import (
    LEDGER_FILE,
    PrivacyError,
    PrivacyLedger,
    Step,
    calibrate_noise,
    epsilon_of,
)


@dataclass(frozen=True)
class BudgetStatus:
    """A dataset's spend, as its ledger says, against a lifetime budget."""

    region: str
    ledger: Path
    budget: float
    spent: float = 0.0  # cumulative epsilon at the ledger's delta; 0: nothing released
    unit: PrivacyUnit | None = None  # None: no ledger yet
    delta: float | None = None
    accountant: Accountant | None = None
    history: list[Step] = field(default_factory=list)
    runs: int = 0
    #: Why the ledger cannot be read (damaged, unreadable): that region declines every
    #: round with this reason, the others are unaffected.
    problem: str = ""

    @property
    def remaining(self) -> float:
        return max(self.budget - self.spent, 0.0)

    def after_run(self, target: float, steps: int) -> float:
        """The dataset's cumulative epsilon after a whole run of ``steps`` DP-SGD steps at
        ``target``, as the region accounts it: noise calibrated for the run alone at the
        sample rate of the dataset's last release (same data, same batch size), composed
        with its history. A dataset with no release: the run's own target."""
        if not self.history or self.delta is None or self.accountant is None:
            return target
        rate = self.history[-1][1]
        with warnings.catch_warnings():  # Opacus' RDP search notes its alpha range: not ours
            warnings.simplefilter("ignore", UserWarning)
            sigma = calibrate_noise(target, self.delta, rate, steps, self.accountant)
        return epsilon_of([*self.history, (sigma, rate, steps)], self.delta, self.accountant)

    def line(self) -> str:
        if self.problem:
            fixed = "the region declines every round until it is fixed"
            return f"{self.region}: {self.problem} ({fixed})"
        if self.unit is None:
            where = f"no ledger yet at {self.ledger}"
            return f"{self.region}: nothing spent, budget {self.budget:g} ({where})"
        return (
            f"{self.region}: epsilon {self.spent:.2f} of {self.budget:g} spent per {self.unit} "
            f"(delta {self.delta:g}, {len(self.history)} release(s) in {self.runs} run(s)), "
            f"{self.remaining:.2f} left"
        )

    def run_line(self, target: float, steps: int) -> tuple[bool, str]:
        """Whether a run at ``target`` of ``steps`` steps fits, and one line saying so."""
        if self.problem:  # line() said why: no run fits
            return False, ""
        after = self.after_run(target, steps)
        fits = after <= self.budget + 1e-9
        line = (
            f"{self.region}: a run at target-epsilon {target:g} ({steps} steps) would bring it "
            f"to {after:.2f} of {self.budget:g}: "
        )
        if fits:
            return True, line + "fits"
        return False, line + (
            f"does not fit (the region declines each round that would go past "
            f"{self.budget:g}); lower target-epsilon, or train on a new dataset"
        )


def budget_status(region: str, state_dir: Path, budget: float) -> BudgetStatus:
    """The spend of the dataset whose state folder is ``state_dir``. A missing ledger is a
    dataset that has released nothing; a damaged one is a status whose ``problem`` names
    the file and the fix, as when a round opens it (one region's damage is its own: the
    others' lines and runs go on)."""
    path = state_dir / LEDGER_FILE
    if not path.exists():
        return BudgetStatus(region, path, budget)
    try:
        ledger = PrivacyLedger.load(path)
    except PrivacyError as err:
        return BudgetStatus(region, path, budget, problem=str(err))
    return BudgetStatus(
        region,
        path,
        budget,
        spent=ledger.epsilon,
        unit=ledger.header.unit,
        delta=ledger.header.delta,
        accountant=ledger.header.accountant,
        history=ledger.history,
        runs=len({r.run_id for r in ledger.rounds}),
    )
