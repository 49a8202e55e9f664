"""Differential privacy for a region: accounting, noise calibration and the privacy ledger.

Epsilon is always computed from the dataset's whole history across runs, never added up
per run. The default accountant, Opacus' PRV (Gopi et al., 2021), is tight, so a target
buys less noise than with RDP (offered for its closed form), which over-estimates.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from opacus import __version__ as opacus_version
from opacus.accountants import create_accountant
from opacus.accountants.analysis import rdp as opacus_rdp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedciuic.audit import LEDGER_WITNESSES, REGION_LOG, Event, load_records, with_carried
from fedciuic.config import (
    COUNTS,
    DEFAULT_PRIVACY_UNIT,
    TRAINING,
    Accountant,
    DPSettings,
    PrivacyUnit,
    Purpose,
)
from fedciuic.errors import FedciuicError
from fedciuic.opacus_logging import undo_opacus_basic_config

undo_opacus_basic_config()


# PRV bounds its domain with this pure RDP series, which each projection would redo.
if not hasattr(opacus_rdp._compute_rdp, "cache_info"):
    opacus_rdp._compute_rdp = lru_cache(maxsize=4096)(opacus_rdp._compute_rdp)
log = logging.getLogger(__name__)

LEDGER_FORMAT: Literal["fedciuic-privacy-ledger/1"] = "fedciuic-privacy-ledger/1"
LEDGER_FILE = "privacy-ledger.jsonl"
#: Domain separation of the ledger's hash chain (see :func:`chain_head`).
HEAD_LABEL = b"\x00fedciuic-privacy-ledger-head/1\x00"

#: One composition step: (noise multiplier, sample rate, number of steps).
Step = tuple[float, float, int]


class PrivacyError(FedciuicError):
    """A DP setting or a privacy ledger is invalid; the region must not train."""


#: Slack for the accountant's numerics when a run's spend is compared with its cap (its
#: history composes in another order than the calibration's).
CAP_TOLERANCE = 1e-6


class BudgetExhausted(FedciuicError):
    """This round would take the region past its epsilon budget: it declines."""


class RunBudgetExceeded(BudgetExhausted):
    """This round would take what this run has actually spent past the run's cap."""


class LedgerRolledBack(PrivacyError):
    """The ledger holds fewer (or other) releases than the region's audit log witnessed."""


def epsilon_of(history: Sequence[Step], delta: float, accountant: Accountant) -> float:
    """Epsilon of a Poisson-subsampled Gaussian mechanism composed over ``history``; steps
    of one (noise, rate) are merged, the same composition, as PRV's cost grows with entries."""
    merged: dict[tuple[float, float], int] = {}
    for sigma, rate, steps in history:
        key = (float(sigma), float(rate))
        merged[key] = merged.get(key, 0) + int(steps)
    entries = tuple((sigma, rate, steps) for (sigma, rate), steps in merged.items())
    return _epsilon(entries, delta, accountant)


@lru_cache(maxsize=256)
def _epsilon(history: tuple[Step, ...], delta: float, accountant: Accountant) -> float:
    if not history:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


#: How close under target a calibrated epsilon ends (Opacus' default), and the bracket's
#: relative width at which the search stops anyway (the accountant is coarser).
EPSILON_TOLERANCE = 0.01
_WIDTH = 1e-3
#: A noise multiplier past which no target is reachable in practice.
_MAX_NOISE = 1e6


def smallest_noise(epsilon_at: Callable[[float], float], target_epsilon: float) -> float:
    """The smallest ``sigma`` with ``epsilon_at(sigma)`` at most ``target_epsilon`` and
    within :data:`EPSILON_TOLERANCE` of it, itself accounted. Each ``epsilon_at`` is a
    whole PRV accounting, so this is a secant search in log space (``log epsilon`` is
    close to linear in ``log sigma``), bisecting every third bracketed guess."""
    aim = math.log(target_epsilon - EPSILON_TOLERANCE / 2)
    low = high = math.nan  # epsilon over target at low; at or under it at high
    points: list[tuple[float, float]] = []  # (log sigma, log epsilon) where finite
    sigma, bracketed = 1.0, 0
    while True:
        eps = epsilon_at(sigma)
        if eps > target_epsilon:
            low = sigma
        else:
            high = sigma
            if target_epsilon - eps <= EPSILON_TOLERANCE:
                return sigma
        if 0 < eps < math.inf:
            points.append((math.log(sigma), math.log(eps)))
        guess = math.nan
        if len(points) >= 2:
            (x1, y1), (x2, y2) = points[-2:]
            if y1 != y2:
                guess = x2 + (aim - y2) * (x2 - x1) / (y2 - y1)
        elif points:  # one point: epsilon about as 1/sigma^2 here, at first
            guess = points[0][0] + (points[0][1] - aim) / 2
        if math.isnan(low) or math.isnan(high):  # not bracketed: at most 4x a step
            here, limit = math.log(sigma), math.log(4.0)
            way = 1.0 if eps > target_epsilon else -1.0  # more noise, or less
            if math.isnan(guess) or (guess - here) * way <= 0:
                guess = here + way * limit
            sigma = math.exp(here + way * min((guess - here) * way, limit))
            if sigma > _MAX_NOISE:
                raise PrivacyError(
                    f"no noise multiplier keeps the run under epsilon {target_epsilon:g}"
                )
            if sigma < 1 / _MAX_NOISE:  # all but no noise already meets the target
                return high
            continue
        if high - low <= _WIDTH * high:
            return high
        left, right = math.log(low), math.log(high)
        bracketed += 1
        if math.isnan(guess) or bracketed % 3 == 0:  # a secant can creep up on one end
            guess = (left + right) / 2
        margin = 0.01 * (right - left)
        sigma = math.exp(min(max(guess, left + margin), right - margin))


def calibrate_noise(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: Accountant
) -> float:
    """The smallest noise multiplier (to 0.01 in epsilon) whose ``steps`` stay under target."""
    return calibrate_noise_after((), target_epsilon, delta, sample_rate, steps, accountant)


@lru_cache(maxsize=64)
def calibrate_noise_after(
    prefix: tuple[Step, ...],
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant,
) -> float:
    """:func:`calibrate_noise` after ``prefix``, the run's other releases
    (:func:`run_prefix`), so that what the run reports bounds all of them."""
    checked = not prefix

    def epsilon_at(sigma: float) -> float:
        nonlocal checked
        eps = epsilon_of([*prefix, (sigma, sample_rate, steps)], delta, accountant)
        if eps > target_epsilon and not checked:  # the prefix alone, only when it may be
            checked = True
            spent = epsilon_of(prefix, delta, accountant)
            if spent >= target_epsilon - EPSILON_TOLERANCE:
                raise PrivacyError(
                    f"run config:target-epsilon: {target_epsilon:g} leaves nothing for "
                    f"training after the run's other releases (its count of units, its "
                    f"evaluations), which cost epsilon {spent:.3f} alone; raise count-noise "
                    "or eval-noise, or target-epsilon"
                )
        return eps

    return smallest_noise(epsilon_at, target_epsilon)


#: Where a region remembers its calibrations (its state folder), across processes and runs.
CALIBRATIONS_FILE = "calibrations.json"


@lru_cache(maxsize=64)
def remembered_noise(
    state_dir: Path,
    prefix: tuple[Step, ...],
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant,
) -> float:
    """:func:`calibrate_noise_after`, remembered in ``state_dir`` across processes. A
    remembered value is used only once an accounting confirms it keeps the run under
    target, so a damaged or edited file can cost utility, never privacy."""
    key = json.dumps(
        [prefix, target_epsilon, delta, sample_rate, steps, accountant, opacus_version]
    )
    path = state_dir / CALIBRATIONS_FILE
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        known = {}
    except (OSError, UnicodeError, ValueError) as err:
        log.warning("%s: unreadable (%s); calibrating again and writing it anew", path, err)
        known = {}
    noise = known.get(key)
    if (
        isinstance(noise, float)
        and noise > 0
        and epsilon_of([*prefix, (noise, sample_rate, steps)], delta, accountant) <= target_epsilon
    ):
        return noise
    noise = calibrate_noise_after(prefix, target_epsilon, delta, sample_rate, steps, accountant)
    known[key] = noise
    tmp = path.with_name(f"{CALIBRATIONS_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known), encoding="utf-8")
    tmp.replace(path)
    return noise


def dp_mean_step(noise: float) -> Step:
    """One DP mean's release (:func:`fedciuic.privacy.dpsgd.dp_mean`: L2 sensitivity
    sqrt 2 in the noise's units) as the accountant composes it."""
    return (noise / math.sqrt(2.0), 1.0, 1)


def count_steps(dp: DPSettings) -> tuple[Step, ...]:
    """A run's DP count of units (sensitivity 1) as the accountant composes it, if any."""
    return ((dp.count_noise, 1.0, 1),) if dp.dp and dp.count_noise > 0 else ()


def evaluations(dp: DPSettings, rounds: int) -> int:
    """The DP evaluations a run of ``rounds`` may release (with eval-noise; 0 without):
    one before its first round, one after each, and one to spare."""
    return rounds + 2 if dp.dp and dp.eval_noise > 0 else 0


def run_prefix(dp: DPSettings, rounds: int) -> tuple[Step, ...]:
    """What a run releases besides its rounds: its DP count and most DP evaluations."""
    return (*count_steps(dp), *[dp_mean_step(dp.eval_noise)] * evaluations(dp, rounds))


def poisson_sample_rate(num_examples: int, batch_size: int) -> float:
    """Opacus' Poisson rate for a loader of ``batch_size``: one over the number of batches."""
    return 1.0 / math.ceil(num_examples / batch_size)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LedgerHeader(_Record):
    """First line of a ledger: whose dataset, per which privacy unit, under which delta.
    A ledger from before units has no ``unit`` (record-level); its lines stay as written."""

    kind: Literal["header"]
    format: Literal["fedciuic-privacy-ledger/1"]
    region: str
    dataset: str = Field(min_length=64, max_length=64)  # SHA-256 of the region's data
    delta: float = Field(gt=0, lt=1)
    accountant: Accountant
    unit: PrivacyUnit = DEFAULT_PRIVACY_UNIT
    created: str


class LedgerRound(_Record):
    """One release (an update, a DP count of units, a DP held-out loss) and its cost."""

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
    #: Noise derived from the run config's seed (insecure-reproducible-noise, tests only).
    reproducible_noise: bool = False
    accountant_state: dict[str, Any]  # Opacus' accountant state_dict: {"history": [...]}
    time: str
    purpose: Purpose = TRAINING
    #: The released count (``counts`` only).
    count: int | None = Field(default=None, ge=0)

    def line(self) -> bytes:
        """The ledger line: a training one without ``purpose`` and ``count``, as written
        before counts existed (its chain head unchanged)."""
        if self.purpose == TRAINING and self.count is None:
            return self.model_dump_json(exclude={"purpose", "count"}).encode()
        return self.model_dump_json().encode()


def chain_head(previous: str | None, line: bytes) -> str:
    """The ledger's head after ``line``: ``SHA-256(label || line)`` for the header,
    ``SHA-256(label || previous head || line)`` for each further line (without its
    newline). The head after k releases names the first k + 1 lines exactly."""
    prev = bytes.fromhex(previous) if previous is not None else b""
    return hashlib.sha256(HEAD_LABEL + prev + line).hexdigest()


@dataclass(frozen=True)
class LedgerWitness:
    """What the region's audit log says its ledger held (see :func:`audit_witness`)."""

    source: Path
    releases: int = 0
    head: str = ""
    epsilon: float = 0.0


class PrivacyLedger:
    """Append-only JSON Lines ledger of a region's privacy spending, on its own disk.

    Writes hold an exclusive ``flock`` (:func:`locked`) and reads under it re-validate the
    whole file, so processes cannot interleave or lose records. Its lines form a hash chain
    whose head the audit log witnesses, so an older or truncated copy is refused.
    """

    def __init__(
        self, path: Path, header: LedgerHeader, rounds: list[LedgerRound], lines: list[bytes]
    ) -> None:
        self.path, self.header, self.rounds = path, header, rounds
        #: The file's lines as written (without newlines): lines[0] is the header.
        self.lines = lines
        #: heads[k]: the chain head after k releases (heads[0] covers the header).
        first = chain_head(None, lines[0])
        self.heads = list(itertools.accumulate(lines[1:], chain_head, initial=first))

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        region: str,
        dataset: str,
        delta: float,
        accountant: Accountant,
        unit: PrivacyUnit,
        witness: LedgerWitness | None = None,
    ) -> PrivacyLedger:
        """Load and check the ledger at ``path``, or start one; refuse one rolled back
        behind ``witness`` (:func:`audit_witness`)."""
        if path.exists():
            ledger = cls.load(path)
            ledger._check_matches(
                region=region, dataset=dataset, delta=delta, accountant=accountant, unit=unit
            )
        else:
            header = LedgerHeader(
                kind="header",
                format=LEDGER_FORMAT,
                region=region,
                dataset=dataset,
                delta=delta,
                accountant=accountant,
                unit=unit,
                created=_now(),
            )
            ledger = cls(path, header, [], [header.model_dump_json().encode()])
        if witness is not None:
            ledger.check_witness(witness, exists=path.exists())
        return ledger

    @classmethod
    def load(cls, path: Path) -> PrivacyLedger:
        """Parse and validate a ledger file; any damage is a :class:`PrivacyError`."""
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise PrivacyError(f"{path}: cannot read the privacy ledger ({err.strerror})") from None
        fix = (
            "keep this file as evidence; if the region's audit log witnessed its releases, "
            f"rebuild it with `fedciuic ledger rebuild --state-path {path.parent}`; never "
            "delete the ledger or restore an older copy to reset the budget"
        )
        if raw and not raw.endswith(b"\n"):
            raise PrivacyError(f"{path}: the last line is truncated (no newline); {fix}")
        lines = raw.split(b"\n")[:-1] if raw else []
        if not lines:
            raise PrivacyError(f"{path}: the privacy ledger is empty; {fix}")
        return cls._of_lines(path, lines, fix)

    @classmethod
    def _of_lines(cls, path: Path, lines: list[bytes], fix: str) -> PrivacyLedger:
        """The ledger of (non-empty) ``lines``, refused at the first bad record, or where
        a history does not extend the previous one by its own step, or epsilon goes down."""
        records: list[Any] = []
        for lineno, line in enumerate(lines, start=1):
            model = LedgerHeader if lineno == 1 else LedgerRound
            try:
                records.append(model.model_validate(json.loads(line.decode("utf-8"))))
            except (ValueError, ValidationError) as err:
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise PrivacyError(
                    f"{path}:{lineno}: corrupted ledger record ({first}); {fix}"
                ) from None
        ledger = cls(path, records[0], records[1:], lines)
        history: list[list[float]] = []
        last_epsilon = 0.0
        for lineno, rec in enumerate(ledger.rounds, start=2):
            history = [*history, [rec.noise_multiplier, rec.sample_rate, rec.steps]]
            got = rec.accountant_state.get("history")
            try:
                same = isinstance(got, list) and [list(map(float, h)) for h in got] == history
            except (TypeError, ValueError):
                same = False
            if not same:
                raise PrivacyError(
                    f"{path}:{lineno}: accountant history does not continue the "
                    f"previous records (edited or reordered); {fix}"
                )
            if rec.delta != ledger.header.delta or rec.epsilon + 1e-9 < last_epsilon:
                raise PrivacyError(
                    f"{path}:{lineno}: delta or cumulative epsilon is inconsistent "
                    f"with the records before it; {fix}"
                )
            last_epsilon = rec.epsilon
        return ledger

    def _check_matches(
        self, *, region: str, dataset: str, delta: float, accountant: Accountant, unit: PrivacyUnit
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
        if h.unit != unit:  # per record says nothing per user, nor the reverse
            raise PrivacyError(
                f"{self.path}: the ledger accounts per {h.unit}, the run asks for privacy-unit "
                f"{unit!r}; a dataset's accounting cannot mix units: set privacy-unit to "
                f"{h.unit!r}, or give the {unit}-level runs their own state-path (and budget)"
            )

    def check_witness(self, witness: LedgerWitness, *, exists: bool = True) -> None:
        """Fail closed unless this ledger holds every release the audit log witnessed,
        with the same chain head: anything else under-reports what was spent."""
        have = len(self.rounds)
        found = (
            "there is no ledger file"
            if not exists
            else f"the ledger has {have} release(s) (head {self.heads[-1][:16]}, epsilon "
            f"{self.epsilon:.3f})"
        )
        rebuild = (
            f"to recover, rebuild the ledger from the audit log with `fedciuic ledger rebuild "
            f"--state-path {self.path.parent}`, which keeps every release the log witnessed and "
            "moves this file aside as evidence; never restore an older copy or delete the "
            "ledger to reset the budget. Nothing was trained or sent"
        )
        if witness.releases > have:
            raise LedgerRolledBack(
                f"privacy ledger {self.path} was rolled back: the audit log {witness.source} "
                f"records {witness.releases} release(s) (head {witness.head[:16]}) but "
                f"{found}: an older copy was restored or the file was truncated or "
                f"deleted, so it under-reports the epsilon spent; {rebuild}"
            )
        if witness.releases and self.heads[witness.releases] != witness.head:
            raise LedgerRolledBack(
                f"privacy ledger {self.path} does not match its audit log: after release "
                f"{witness.releases} the audit log {witness.source} records head "
                f"{witness.head[:16]}, the ledger has {self.heads[witness.releases][:16]}: the "
                f"file was replaced by another copy or its records were edited; {rebuild}"
            )
        if self.epsilon + 1e-9 < witness.epsilon:
            raise LedgerRolledBack(
                f"privacy ledger {self.path} was rolled back: the audit log {witness.source} "
                f"records a cumulative epsilon of {witness.epsilon:.3f} but {found}; {rebuild}"
            )

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

    def run_count(self, run_id: int) -> int | None:
        """The DP count of units run ``run_id`` released (None: none yet)."""
        counts = (r.count for r in self.rounds if r.purpose == COUNTS and r.run_id == run_id)
        return next(counts, None)

    def released(self, run_id: int, server_round: int) -> bool:
        """Whether round ``server_round`` of run ``run_id`` released its update."""
        return any(
            r.purpose == TRAINING and r.run_id == run_id and r.round == server_round
            for r in self.rounds
        )

    def run_releases(self, run_id: int, purpose: Purpose) -> int:
        """How many releases of ``purpose`` run ``run_id`` has made."""
        return sum(r.run_id == run_id and r.purpose == purpose for r in self.rounds)

    def run_history(self, run_id: int) -> list[Step]:
        """The steps this run (federation run id) has actually released."""
        return [s for r, s in zip(self.rounds, self.history, strict=True) if r.run_id == run_id]

    def run_epsilon_after(self, run_id: int, step: Step) -> float:
        """What run ``run_id`` will have spent, on its own, if ``step`` is released next."""
        return epsilon_of(
            [*self.run_history(run_id), step], self.header.delta, self.header.accountant
        )

    def admit(
        self, step: Step, *, budget: float, run_id: int, server_round: int, cap: tuple[float, str]
    ) -> tuple[float, float]:
        """The dataset's and the run's epsilon if ``step`` is released next, within
        ``budget`` and the run's ``cap`` (its value and where it is set)."""
        after = self.epsilon_after(step)
        where = f"delta {self.header.delta:g}, ledger {self.path}"
        if after > budget:
            raise BudgetExhausted(
                f"region {self.header.region}: this round would raise epsilon from "
                f"{self.epsilon:.3f} to {after:.3f}, over the dataset's budget {budget:g} "
                f"({where}); nothing was trained or sent"
            )
        spent = self.run_history(run_id)
        run_after = self.run_epsilon_after(run_id, step)
        if run_after > cap[0] + CAP_TOLERANCE:
            before = epsilon_of(spent, self.header.delta, self.header.accountant)
            raise RunBudgetExceeded(
                f"region {self.header.region}: round {server_round} would raise what run "
                f"{run_id} has actually spent from epsilon {before:.3f} ({len(spent)} "
                f"release(s) in {self.path}) to {run_after:.3f}, over the per-run cap of "
                f"{cap[1]}; nothing was trained or sent"
            )
        return after, run_after

    def append(self, record: LedgerRound) -> None:
        """Append one round and flush it to disk before anything is released."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = record.line().decode()
        lines = [line] if self.path.exists() else [self.header.model_dump_json(), line]
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in lines))
            handle.flush()
            os.fsync(handle.fileno())
        self.rounds.append(record)
        self.lines.append(line.encode())
        self.heads.append(chain_head(self.heads[-1], self.lines[-1]))

    def witness_record(self, pending: LedgerRound | None = None) -> dict[str, Any]:
        """What the audit log keeps of the ledger after a release (or ``pending``): the
        releases and head, checked on every open, and the last line and header (base64)
        for :func:`rebuild_ledger`."""
        last = self.lines[-1] if self.rounds else b""
        releases, head = len(self.rounds), self.heads[-1]
        if pending is not None:
            last = pending.line()
            releases, head = releases + 1, chain_head(head, last)
        return {
            "file": self.path.name,
            "releases": releases,
            "head": head,
            "line": base64.b64encode(last).decode("ascii"),
            "header": base64.b64encode(self.lines[0]).decode("ascii"),
        }

    def new_record(
        self,
        *,
        run_id: int,
        server_round: int,
        step: Step,
        max_grad_norm: float,
        secure_mode: bool,
        epsilon: float,
        reproducible_noise: bool = False,
        purpose: Purpose = TRAINING,
        count: int | None = None,
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
            reproducible_noise=reproducible_noise,
            accountant_state={"history": history, "mechanism": self.header.accountant},
            time=_now(),
            purpose=purpose,
            count=count,
        )


# -- the audit log as the ledger's witness ----------------------------------------------


def audit_witness(audit_path: Path, *, region: str, dataset: str) -> LedgerWitness | None:
    """The most releases (and the head then) and the highest epsilon the region's audit
    log witnessed of this ledger; None without a log, an error if it is unreadable."""
    if not audit_path.exists():
        return None
    releases, head, epsilon = 0, "", 0.0
    for _, details in _witnesses(audit_path, region, dataset):
        eps = details.get("epsilon")
        if isinstance(eps, int | float) and math.isfinite(eps):
            epsilon = max(epsilon, float(eps))
        seen = _witnessed(details.get("ledger"))
        if seen is not None and seen[0] >= releases:  # the latest witness of the longest
            releases, head = seen[0], seen[1]
    return LedgerWitness(audit_path, releases, head, epsilon)


def _witnesses(
    audit_path: Path, region: str, dataset: str
) -> Iterator[tuple[Mapping[str, Any], dict[str, Any]]]:
    """The audit records (and details) witnessing this ledger, carried ones included."""
    for record in with_carried(load_records(audit_path)):
        details = record.get("details")
        if record.get("event") not in LEDGER_WITNESSES or not isinstance(details, dict):
            continue
        if record.get("actor") == region and details.get("data_fingerprint") == dataset:
            yield record, details


def _witnessed(value: object) -> tuple[int, str, bytes, bytes] | None:
    if not isinstance(value, dict):
        return None
    count, head = value.get("releases"), value.get("head")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    if not isinstance(head, str) or len(head) != 64:
        return None
    try:
        line = base64.b64decode(str(value.get("line", "")), validate=True)
        header = base64.b64decode(str(value.get("header", "")), validate=True)
    except (binascii.Error, ValueError):
        line = header = b""
    return count, head, line, header


#: The infix of the replaced file a rebuild keeps next to it, which later rebuilds read.
KEPT_ASIDE = ".rolled-back-"


@dataclass(frozen=True)
class LedgerSource:
    """One witness of a ledger that :func:`rebuild_ledger` read, and what it shows."""

    path: Path
    kind: str
    releases: int  # the most releases it shows (0: it holds no ledger line)
    epsilon: float  # the highest cumulative epsilon it records
    damaged: int = 0  # lines that are not ledger records, skipped


class RebuildRefused(PrivacyError):
    """The sources of a rebuild disagree beyond one ledger; nothing was changed."""

    def __init__(self, message: str, sources: Sequence[LedgerSource]) -> None:
        super().__init__(message)
        self.sources = tuple(sources)


@dataclass(frozen=True)
class Rebuilt:
    """What :func:`rebuild_ledger` did."""

    path: Path
    releases: int
    from_audit: int  # releases whose line the region's audit log holds
    kept_aside: Path | None  # the file it replaced, kept as evidence
    epsilon: float
    sources: tuple[LedgerSource, ...] = ()
    #: origins[k - 1]: the sources that hold release k's line (in the order of sources)
    origins: tuple[tuple[Path, ...], ...] = ()


@dataclass
class _Read:
    """What one source holds, each line with where it was read (for the messages)."""

    path: Path
    kind: str
    headers: dict[bytes, str] = field(default_factory=dict)
    lines: dict[int, dict[bytes, str]] = field(default_factory=dict)  # release k -> line
    heads: dict[int, dict[str, str]] = field(default_factory=dict)  # witnessed head after k
    epsilon: float = 0.0
    epsilon_at: str = ""
    damaged: int = 0

    def line(self, k: int, line: bytes, where: str) -> None:
        self.lines.setdefault(k, {}).setdefault(line, where)

    def spent(self, epsilon: float, where: str) -> None:
        if epsilon > self.epsilon:
            self.epsilon, self.epsilon_at = epsilon, where

    def summary(self) -> LedgerSource:
        releases = max([*self.lines, *self.heads], default=0)
        return LedgerSource(self.path, self.kind, releases, self.epsilon, self.damaged)


def rebuild_ledger(state_dir: Path, *, aggregator_log: Path | None = None) -> Rebuilt:
    """Rebuild the ledger in ``state_dir`` from every witness: the current file, files
    earlier rebuilds kept aside, the audit log's lines and heads, and the epsilon
    ``aggregator_log`` recorded (a floor only).

    Dropping a release would hand spent budget back, so the result is the sources' union
    by release position, refused (:class:`RebuildRefused`, nothing changed) unless it holds
    every release, reaches every recorded epsilon, reproduces every witnessed head and
    passes the ledger's own checks. The replaced file is kept aside as evidence."""
    path = state_dir / LEDGER_FILE
    audit_path = state_dir / REGION_LOG
    with locked(path):
        files = [_read_file(path, "current ledger")] if path.exists() else []
        earlier = sorted(path.parent.glob(f"{path.name}{KEPT_ASIDE}*"))
        kept = [_read_file(p, "kept aside by an earlier rebuild") for p in earlier]
        files += kept
        header = _identity(files, audit_path)
        audit = _read_audit(audit_path, header) if header is not None else None
        reads = [*files, *([audit] if audit is not None else [])]
        witnessed = audit is not None and bool(audit.lines or audit.heads)
        if header is None or not (witnessed or any(r.lines for r in kept)):
            raise PrivacyError(
                f"{audit_path}: the audit log witnesses no release of this ledger and no "
                f"earlier copy is kept aside, so there is nothing to rebuild {path} from; "
                "keep both files and investigate"
            )
        if aggregator_log is not None:
            from fedciuic.data import state_commitments  # a rebuild's alone: heavy import

            reads.append(_read_aggregator(aggregator_log, header, state_commitments(state_dir)))
        sources = [r.summary() for r in reads]
        try:
            out, origins = _union(path, reads)
        except PrivacyError as err:
            raise RebuildRefused(str(err), sources) from None
        tmp = path.with_name(path.name + ".rebuilt")
        with open(tmp, "wb") as handle:
            handle.write(b"".join(line + b"\n" for line in out))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            done = PrivacyLedger.load(tmp)  # the ledger's own checks, on what will be the ledger
        except PrivacyError:
            tmp.unlink()
            raise
        aside = None
        if path.exists():
            aside = _aside_name(path)
            os.replace(path, aside)
        os.replace(tmp, path)
    from_audit = sum(audit is not None and audit.path in held for held in origins)
    return Rebuilt(
        path, len(done.rounds), from_audit, aside, done.epsilon, tuple(sources), tuple(origins)
    )


def _union(path: Path, reads: list[_Read]) -> tuple[list[bytes], list[tuple[Path, ...]]]:
    """The ledger's lines that every source agrees with, and which sources hold each
    release; a :class:`PrivacyError` naming the sources where no single ledger can."""
    keep = "keep every file and investigate (nothing was changed)"
    headers: dict[bytes, str] = {}
    releases: dict[int, dict[bytes, list[tuple[Path, str]]]] = {}
    for read in reads:
        for line, where in read.headers.items():
            headers.setdefault(line, where)
        for k, variants in read.lines.items():
            for line, where in variants.items():
                releases.setdefault(k, {}).setdefault(line, []).append((read.path, where))
    if len(headers) != 1:
        if not headers:
            raise PrivacyError(f"cannot rebuild {path}: no source holds its header line; {keep}")
        (a, at_a), (b, at_b) = list(headers.items())[:2]
        raise PrivacyError(
            f"cannot rebuild {path}: two ledgers for one dataset: {at_a} and {at_b} hold "
            f"different headers ({_describe(a)}; {_describe(b)}); each one's releases were "
            f"spent on the dataset, and one ledger cannot hold both: {keep}"
        )
    for k in sorted(releases):
        if len(releases[k]) > 1:
            (a, held_a), (b, held_b) = list(releases[k].items())[:2]
            raise PrivacyError(
                f"cannot rebuild {path}: two ledgers for one dataset: release {k} is "
                f"{_describe(a)} in {held_a[0][1]} but {_describe(b)} in {held_b[0][1]}; "
                f"both were spent on the dataset, and one ledger cannot hold both: {keep}"
            )
    top = max([*releases, *(k for read in reads for k in read.heads)], default=0)
    for k in range(1, top + 1):
        if k not in releases:
            names = ", ".join(str(read.path) for read in reads)
            raise PrivacyError(
                f"cannot rebuild {path}: release {k} is recorded in none of {names}; its "
                f"cost is unknown, so the ledger cannot be completed: {keep}"
            )
    out = [next(iter(headers))] + [next(iter(releases[k])) for k in range(1, top + 1)]
    fix = f"the sources' lines do not form one ledger: {keep}"
    ledger = PrivacyLedger._of_lines(path, out, fix)
    for read in reads:
        for k, heads in read.heads.items():
            for head, where in heads.items():
                if ledger.heads[k] != head:
                    raise PrivacyError(
                        f"cannot rebuild {path}: after release {k}, {where} witnessed head "
                        f"{head[:16]}, the releases the sources hold give {ledger.heads[k][:16]}: "
                        f"it witnessed another ledger of this dataset (a fork); {keep}"
                    )
    for read in reads:
        if read.epsilon > ledger.epsilon + 1e-9:
            raise PrivacyError(
                f"cannot rebuild {path}: {read.epsilon_at} records a cumulative epsilon of "
                f"{read.epsilon:.3f}, the releases the sources hold reach {ledger.epsilon:.3f}: "
                f"a release recorded there, whose ledger line no source holds, would be "
                f"dropped; {keep}"
            )
    order = [read.path for read in reads]
    origins = [
        tuple(p for p in order if any(p == held for held, _ in releases[k][line]))
        for k, line in enumerate(out[1:], start=1)
    ]
    return out, origins


def _read_file(path: Path, kind: str) -> _Read:
    """Every ledger line of a file by its history's length; a damaged one is counted."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise PrivacyError(
            f"{path}: cannot read this copy of the privacy ledger ({err.strerror}); make it "
            "readable: a rebuild reads every copy"
        ) from None
    read = _Read(path, kind)
    pieces = raw.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()
    for number, line in enumerate(pieces, start=1):
        where = f"{path}:{number}"
        try:
            LedgerHeader.model_validate(json.loads(line.decode("utf-8")))
        except ValueError:
            pass
        else:
            read.headers.setdefault(line, where)
            continue
        found = _release_at(line)
        if found is None:
            read.damaged += 1
            continue
        read.line(found[0], line, where)
        read.spent(found[1], where)
    return read


def _release_at(line: bytes) -> tuple[int, float] | None:
    """A release line's position (its accountant history's length) and epsilon."""
    try:
        record = LedgerRound.model_validate(json.loads(line.decode("utf-8")))
    except ValueError:
        return None
    history = record.accountant_state.get("history")
    return (len(history), record.epsilon) if isinstance(history, list) and history else None


def _aside_name(path: Path) -> Path:
    """A new name for the replaced file: never one an earlier rebuild's evidence has."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = path.with_name(f"{path.name}{KEPT_ASIDE}{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}{KEPT_ASIDE}{stamp}-{n}"), n + 1
    return aside


def _identity(files: list[_Read], audit_path: Path) -> LedgerHeader | None:
    """The first copy's header, or else the one the audit log's last witness names."""
    candidates = [line for read in files for line in read.headers]
    if not candidates and audit_path.exists():
        for record in reversed(list(with_carried(load_records(audit_path)))):
            details = record.get("details")
            if record.get("event") in LEDGER_WITNESSES and isinstance(details, dict):
                seen = _witnessed(details.get("ledger"))
                if seen is not None and seen[3]:
                    candidates.append(seen[3])
                    break
    for line in candidates:
        try:
            return LedgerHeader.model_validate_json(line)
        except ValidationError:
            continue
    return None


def _read_audit(audit_path: Path, header: LedgerHeader) -> _Read | None:
    """What the region's audit log witnessed of this dataset's ledger, for a rebuild."""
    if not audit_path.exists():
        return None
    read = _Read(audit_path, "region audit log")
    for record, details in _witnesses(audit_path, header.region, header.dataset):
        where = f"{audit_path} (record seq {record.get('seq')})"
        eps = details.get("epsilon")
        if isinstance(eps, int | float) and not isinstance(eps, bool) and math.isfinite(eps):
            read.spent(float(eps), where)
        seen = _witnessed(details.get("ledger"))
        if seen is None:
            continue
        count, head, line, header_line = seen
        read.heads.setdefault(count, {}).setdefault(head, where)
        if header_line:
            read.headers.setdefault(header_line, where)
        found = _release_at(line) if line else None
        if found is not None and found[0] == count:
            read.line(count, line, where)
            read.spent(found[1], where)
        elif line:
            read.damaged += 1
    return read


def _read_aggregator(
    log_path: Path, header: LedgerHeader, commit: Callable[[str, int], str] | None = None
) -> _Read:
    """The highest epsilon the aggregator's log recorded for this dataset's accepted
    updates (per this ledger's unit; named by its digest or by ``commit``, the region's
    commitment to it in the record's run): a floor, as it keeps no ledger line."""
    if not log_path.is_file():
        raise PrivacyError(
            f"{log_path}: no aggregator audit log there; give --aggregator-log the "
            "aggregator's aggregator.audit.jsonl (in its audit folder), or leave it out"
        )
    read = _Read(log_path, "aggregator audit log, epsilon only")
    for record in load_records(log_path):
        details = record.get("details")
        if record.get("event") != Event.UPDATE_ACCEPTED or not isinstance(details, dict):
            continue
        if details.get("region") != header.region:
            continue
        if details.get("unit", "record") != header.unit:  # no unit: logged before units
            continue
        run_id = record.get("run_id")
        ours = {header.dataset}
        if commit is not None and isinstance(run_id, int):
            ours.add(commit(header.dataset, run_id))
        if details.get("data_fingerprint", header.dataset) not in ours:
            continue
        eps = details.get("epsilon")
        if isinstance(eps, int | float) and not isinstance(eps, bool) and math.isfinite(eps):
            where = (
                f"{log_path} (record seq {record.get('seq')}: region {header.region}'s update "
                f"of run {record.get('run_id')} round {record.get('round')})"
            )
            read.spent(float(eps), where)
    return read


def _describe(line: bytes) -> str:
    """A ledger line in a few words, for a refusal that names two of them."""
    try:
        data = json.loads(line.decode("utf-8"))
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return "unreadable"
    if data.get("kind") == "header":
        return f"created {data.get('created')}"
    eps = data.get("epsilon")
    at = f"{eps:.3f}" if isinstance(eps, int | float) else "?"
    return f"run {data.get('run_id')} round {data.get('round')} at epsilon {at}"


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


def rebuild_ledger_command(state_path: Path, aggregator_log: Path | None = None) -> int:
    """``fedciuic ledger rebuild``: :func:`rebuild_ledger`, with what each source showed."""
    try:
        done = rebuild_ledger(
            state_path.expanduser(),
            aggregator_log=aggregator_log.expanduser() if aggregator_log is not None else None,
        )
    except RebuildRefused as err:
        _print_sources(err.sources)
        raise
    _print_sources(done.sources)
    k = 1
    for held, run in itertools.groupby(done.origins):
        last = k + len(list(run)) - 1
        which = f"release {k}" if last == k else f"releases {k}-{last}"
        print(f"{which}: from {', '.join(p.name for p in held)}")
        k = last + 1
    print(
        f"rebuilt {done.path}: {done.releases} release(s), epsilon {done.epsilon:.3f}, "
        "not below any source's"
    )
    if done.kept_aside is not None:
        print(f"the rolled-back file is kept as evidence: {done.kept_aside}")
    return 0


def _print_sources(sources: Sequence[LedgerSource]) -> None:
    for s in sources:
        shows = f"{s.releases} release(s)" if s.releases else "no ledger line"
        damaged = f", {s.damaged} damaged line(s) skipped" if s.damaged else ""
        print(f"source {s.path} ({s.kind}): {shows}, epsilon {s.epsilon:.3f}{damaged}")
