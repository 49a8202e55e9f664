"""What a region's dataset has spent against its lifetime budget, read from its ledger.

``fedciuic budget`` and ``fedciuic simulate`` show it before a run starts, so that a run
whose target no longer fits is seen on the launching machine, not as declined rounds.
Reading changes nothing: the ledger is parsed and checked as a round would open it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedciuic.config import PrivacyUnit
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger


@dataclass(frozen=True)
class BudgetStatus:
    """A dataset's spend, as its ledger says, against a lifetime budget."""

    region: str
    ledger: Path
    budget: float
    spent: float = 0.0  # cumulative epsilon at the ledger's delta; 0: nothing released
    unit: PrivacyUnit | None = None  # None: no ledger yet
    delta: float | None = None
    releases: int = 0
    runs: int = 0

    @property
    def remaining(self) -> float:
        return max(self.budget - self.spent, 0.0)

    def fits(self, target: float) -> bool:
        """Whether a run that spends at most ``target`` on its own fits in what is left. A
        rule of thumb for the launching machine: composed, runs cost less than the sum of
        their epsilons, and the region checks each round's exact cumulative epsilon."""
        return self.spent + target <= self.budget + 1e-9

    def line(self) -> str:
        if self.unit is None:
            where = f"no ledger yet at {self.ledger}"
            return f"{self.region}: nothing spent, budget {self.budget:g} ({where})"
        return (
            f"{self.region}: epsilon {self.spent:.2f} of {self.budget:g} spent per {self.unit} "
            f"(delta {self.delta:g}, {self.releases} release(s) in {self.runs} run(s)), "
            f"{self.remaining:.2f} left"
        )


def budget_status(region: str, state_dir: Path, budget: float) -> BudgetStatus:
    """The spend of the dataset whose state folder is ``state_dir``. A missing ledger is a
    dataset that has released nothing; a damaged one is a ``PrivacyError`` naming the file
    and the fix, as when a round opens it."""
    path = state_dir / LEDGER_FILE
    if not path.exists():
        return BudgetStatus(region, path, budget)
    ledger = PrivacyLedger.load(path)
    return BudgetStatus(
        region,
        path,
        budget,
        spent=ledger.epsilon,
        unit=ledger.header.unit,
        delta=ledger.header.delta,
        releases=len(ledger.rounds),
        runs=len({r.run_id for r in ledger.rounds}),
    )
