"""What a region's dataset has spent against its lifetime budget, read from its ledger.

``fedciuic budget`` and ``fedciuic simulate`` show it before a run, so a target that no
longer fits is seen on the launching machine, not as declined rounds. Reading changes nothing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fedciuic.config import TRAINING, Accountant, PrivacyUnit
from fedciuic.privacy.ledger import (
    LEDGER_FILE,
    PrivacyError,
    PrivacyLedger,
    Step,
    calibrate_noise_after,
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
    #: Each release's purpose (``training``, ``counts``), in the history's order.
    purposes: list[str] = field(default_factory=list)
    runs: int = 0
    #: Why the ledger cannot be read: that region declines every round with this reason.
    problem: str = ""

    @property
    def remaining(self) -> float:
        return max(self.budget - self.spent, 0.0)

    def by_purpose(self) -> dict[str, float]:
        """Each purpose's epsilon on its own (they compose to :attr:`spent`, not add up)."""
        if self.delta is None or self.accountant is None:
            return {}
        return {
            purpose: epsilon_of(self._steps(purpose), self.delta, self.accountant)
            for purpose in dict.fromkeys(self.purposes)
        }

    def _steps(self, purpose: str) -> list[Step]:
        return [s for s, p in zip(self.history, self.purposes, strict=True) if p == purpose]

    def after_run(self, target: float, steps: int, prefix: tuple[Step, ...] = ()) -> float:
        """The dataset's epsilon after a run of ``steps`` at ``target``, calibrated after
        ``prefix`` (:func:`~fedciuic.privacy.ledger.run_prefix`) at the last training rate."""
        trained = self._steps(TRAINING)
        if not trained or self.delta is None or self.accountant is None:
            return target
        rate = trained[-1][1]
        with warnings.catch_warnings():  # Opacus' RDP search notes its alpha range: not ours
            warnings.simplefilter("ignore", UserWarning)
            sigma = calibrate_noise_after(prefix, target, self.delta, rate, steps, self.accountant)
        run = [*prefix, (sigma, rate, steps)]
        return epsilon_of([*self.history, *run], self.delta, self.accountant)

    def line(self) -> str:
        if self.problem:
            fixed = "the region declines every round until it is fixed"
            return f"{self.region}: {self.problem} ({fixed})"
        if self.unit is None:
            where = f"no ledger yet at {self.ledger}"
            return f"{self.region}: nothing spent, budget {self.budget:g} ({where})"
        purposes = self.by_purpose()
        alone = (
            ": " + ", ".join(f"{p} alone {e:.2f}" for p, e in purposes.items())
            if len(purposes) > 1
            else ""
        )
        return (
            f"{self.region}: epsilon {self.spent:.2f} of {self.budget:g} spent per {self.unit} "
            f"(delta {self.delta:g}, {len(self.history)} release(s) in {self.runs} "
            f"run(s){alone}), {self.remaining:.2f} left"
        )

    def run_line(
        self, target: float, steps: int, prefix: tuple[Step, ...] = ()
    ) -> tuple[bool, str]:
        """Whether a run at ``target`` of ``steps`` steps fits, and a line saying so."""
        if self.problem:  # line() said why: no run fits
            return False, ""
        after = self.after_run(target, steps, prefix)
        line = (
            f"{self.region}: a run at target-epsilon {target:g} ({steps} steps) would bring it "
            f"to {after:.2f} of {self.budget:g}: "
        )
        if after <= self.budget + 1e-9:
            return True, line + "fits"
        return False, line + (
            f"does not fit (the region declines each round that would go past "
            f"{self.budget:g}); lower target-epsilon, or train on a new dataset"
        )


def budget_status(region: str, state_dir: Path, budget: float) -> BudgetStatus:
    """The spend of the dataset in ``state_dir``; a damaged ledger is a ``problem``."""
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
        purposes=[r.purpose for r in ledger.rounds],
        runs=len({r.run_id for r in ledger.rounds}),
    )
