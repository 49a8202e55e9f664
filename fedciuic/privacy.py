"""Differential privacy for a region: accounting, noise calibration and the privacy ledger.

Three tiers, as in Opacus: pure functions (:func:`epsilon_of`, :func:`calibrate_noise`),
a small stateful :class:`PrivacyLedger` that saves and loads itself, and the DP-SGD
training step in :mod:`fedciuic.dp_train`.

Accounting is over the whole history of a region's dataset, across runs: the ledger
holds every (noise multiplier, sample rate, steps) the dataset was trained with, and
epsilon is always computed from that full history, never added up per run.

The default accountant is Opacus' PRV accountant (Gopi et al., 2021): it computes
epsilon numerically from the privacy loss distribution and is tight, so the same
target epsilon buys less noise than with RDP (whose conversion to (epsilon, delta)
over-estimates). RDP is offered for those who need its closed form. Both agree with
Google's ``dp-accounting`` (PLD and RDP respectively) in the tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedciuic._opacus_logging import undo_opacus_basic_config
from fedciuic.errors import FedciuicError

undo_opacus_basic_config()

Accountant = Literal["prv", "rdp"]
LEDGER_FORMAT: Literal["fedciuic-privacy-ledger/1"] = "fedciuic-privacy-ledger/1"
LEDGER_FILE = "privacy-ledger.jsonl"

#: One composition step: (noise multiplier, sample rate, number of steps).
Step = tuple[float, float, int]


class PrivacyError(FedciuicError):
    """A DP setting or a privacy ledger is invalid; the region must not train."""


class BudgetExhausted(FedciuicError):
    """This round would take the region past its epsilon budget: it declines."""


def epsilon_of(history: Sequence[Step], delta: float, accountant: Accountant) -> float:
    """Epsilon of a Poisson-subsampled Gaussian mechanism composed over ``history``."""
    if not history:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(s), float(q), int(n)) for s, q, n in history]
    return float(acc.get_epsilon(delta=delta))


@lru_cache(maxsize=64)
def calibrate_noise(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: Accountant
) -> float:
    """The smallest noise multiplier (to 0.01 in epsilon) whose ``steps`` stay under target."""
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=0.01,
        )
    )


def poisson_sample_rate(num_examples: int, batch_size: int) -> float:
    """Opacus' Poisson rate for a loader of ``batch_size``: one over the number of batches."""
    return 1.0 / math.ceil(num_examples / batch_size)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LedgerHeader(_Record):
    """First line of a ledger: whose dataset it accounts for, and under which delta."""

    kind: Literal["header"]
    format: Literal["fedciuic-privacy-ledger/1"]
    region: str
    dataset: str = Field(min_length=64, max_length=64)  # SHA-256 of the region's data
    delta: float = Field(gt=0, lt=1)
    accountant: Accountant
    created: str


class LedgerRound(_Record):
    """One released round: what it cost and where the accounting stands after it."""

    kind: Literal["round"]
    run_id: int
    round: int = Field(ge=0)
    noise_multiplier: float = Field(ge=0)
    sample_rate: float = Field(gt=0, le=1)
    steps: int = Field(ge=1)
    max_grad_norm: float = Field(gt=0)
    delta: float = Field(gt=0, lt=1)
    epsilon: float = Field(ge=0)  # cumulative over the dataset's whole history
    secure_mode: bool
    accountant_state: dict[str, Any]  # Opacus' accountant state_dict: {"history": [...]}
    time: str


class PrivacyLedger:
    """Append-only JSON Lines ledger of a region's privacy spending, on its own disk.

    Every write holds an exclusive ``flock`` on ``<ledger>.lock``, and every read
    under that lock re-validates the whole file, so two processes of one region
    cannot interleave or lose records.
    """

    def __init__(self, path: Path, header: LedgerHeader, rounds: list[LedgerRound]) -> None:
        self.path = path
        self.header = header
        self.rounds = rounds

    # -- reading ----------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        region: str,
        dataset: str,
        delta: float,
        accountant: Accountant,
    ) -> PrivacyLedger:
        """Load and check the ledger at ``path``, or start one for this dataset."""
        if path.exists():
            ledger = cls.load(path)
            ledger._check_matches(
                region=region, dataset=dataset, delta=delta, accountant=accountant
            )
            return ledger
        header = LedgerHeader(
            kind="header",
            format=LEDGER_FORMAT,
            region=region,
            dataset=dataset,
            delta=delta,
            accountant=accountant,
            created=_now(),
        )
        return cls(path, header, [])

    @classmethod
    def load(cls, path: Path) -> PrivacyLedger:
        """Parse and validate a ledger file; any damage is a :class:`PrivacyError`."""
        fix = "restore it from a backup; never delete it to reset the budget"
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise PrivacyError(f"{path}: cannot read the privacy ledger ({err.strerror})") from None
        if raw and not raw.endswith(b"\n"):
            raise PrivacyError(f"{path}: the last line is truncated (no newline); {fix}")
        lines = raw.decode("utf-8", errors="replace").splitlines()
        if not lines:
            raise PrivacyError(f"{path}: the privacy ledger is empty; {fix}")
        header: LedgerHeader | None = None
        rounds: list[LedgerRound] = []
        for lineno, line in enumerate(lines, start=1):
            try:
                data = json.loads(line)
                if lineno == 1:
                    header = LedgerHeader.model_validate(data)
                else:
                    rounds.append(LedgerRound.model_validate(data))
            except (ValueError, ValidationError) as err:
                first = str(err).splitlines()[0]
                raise PrivacyError(
                    f"{path}:{lineno}: corrupted ledger record ({first}); {fix}"
                ) from None
        assert header is not None
        ledger = cls(path, header, rounds)
        ledger._check_chain(fix)
        return ledger

    def _check_chain(self, fix: str) -> None:
        # Each record's accountant history must extend the previous one by exactly
        # its own step, with the header's delta, and epsilon may never go down.
        history: list[list[float]] = []
        last_epsilon = 0.0
        for lineno, rec in enumerate(self.rounds, start=2):
            history = [*history, [rec.noise_multiplier, rec.sample_rate, rec.steps]]
            got = rec.accountant_state.get("history")
            if not isinstance(got, list) or [list(map(float, h)) for h in got] != [
                list(map(float, h)) for h in history
            ]:
                raise PrivacyError(
                    f"{self.path}:{lineno}: accountant history does not continue the "
                    f"previous records (edited or reordered); {fix}"
                )
            if rec.delta != self.header.delta or rec.epsilon + 1e-9 < last_epsilon:
                raise PrivacyError(
                    f"{self.path}:{lineno}: delta or cumulative epsilon is inconsistent "
                    f"with the records before it; {fix}"
                )
            last_epsilon = rec.epsilon

    def _check_matches(
        self, *, region: str, dataset: str, delta: float, accountant: Accountant
    ) -> None:
        h = self.header
        if h.dataset != dataset or h.region != region:
            raise PrivacyError(
                f"{self.path}: this ledger belongs to region {h.region!r}, dataset "
                f"{h.dataset[:12]}, not to region {region!r}, dataset {dataset[:12]}; a changed "
                "dataset needs its own state-path (and its own budget)"
            )
        if not math.isclose(h.delta, delta, rel_tol=1e-12):
            raise PrivacyError(
                f"{self.path}: the ledger accounts with delta {h.delta:g}, the run asks for "
                f"{delta:g}; keep target-delta at {h.delta:g} for this dataset"
            )
        if h.accountant != accountant:
            raise PrivacyError(
                f"{self.path}: the ledger uses the {h.accountant} accountant, the run asks for "
                f"{accountant}; set dp-accountant to {h.accountant!r} for this dataset"
            )

    # -- accounting ---------------------------------------------------------------

    @property
    def history(self) -> list[Step]:
        return [(r.noise_multiplier, r.sample_rate, r.steps) for r in self.rounds]

    @property
    def epsilon(self) -> float:
        """Cumulative epsilon spent on this dataset so far."""
        return self.rounds[-1].epsilon if self.rounds else 0.0

    def epsilon_after(self, step: Step) -> float:
        """Cumulative epsilon if ``step`` were released next."""
        return epsilon_of([*self.history, step], self.header.delta, self.header.accountant)

    # -- writing ------------------------------------------------------------------

    def append(self, record: LedgerRound) -> None:
        """Append one round and flush it to disk before anything is released."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        if not self.path.exists():
            lines.append(self.header.model_dump_json())
        lines.append(record.model_dump_json())
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in lines))
            handle.flush()
            os.fsync(handle.fileno())
        self.rounds.append(record)

    def new_record(
        self,
        *,
        run_id: int,
        server_round: int,
        step: Step,
        max_grad_norm: float,
        secure_mode: bool,
        epsilon: float,
    ) -> LedgerRound:
        history = [[float(s), float(q), int(n)] for s, q, n in [*self.history, step]]
        return LedgerRound(
            kind="round",
            run_id=run_id,
            round=server_round,
            noise_multiplier=step[0],
            sample_rate=step[1],
            steps=step[2],
            max_grad_norm=max_grad_norm,
            delta=self.header.delta,
            epsilon=epsilon,
            secure_mode=secure_mode,
            accountant_state={"history": history, "mechanism": self.header.accountant},
            time=_now(),
        )


@contextlib.contextmanager
def locked(path: Path, timeout: float = 600.0) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` + ``.lock``; fail after ``timeout`` seconds."""
    lock_path = path.with_name(path.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PrivacyError(
                        f"{lock_path}: held by another process of this region for over "
                        f"{timeout:.0f}s; stop the other process or wait for it"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
