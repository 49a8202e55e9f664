"""One region's model, data, DP and privacy ledger, and the release of its updates.

:meth:`Release.send` is the one place a release is noted: the update kept for resending,
the ledger's record (the commit), then the ``trained`` audit note that witnesses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from fedciuic.audit import OUTSIDE_DP, REGION_LOG, Event, load_records
from fedciuic.cluster import (
    ClusterStats,
    ForwardOp,
    TrainCommand,
    TrainingCluster,
    check_sharding,
    forward_work,
)
from fedciuic.compression import (
    Codec,
    ErrorFeedback,
    compress_with_feedback,
    flatten,
    layout_id,
    layout_of,
    update_entries,
)
from fedciuic.config import (
    COUNTS,
    DEFAULT_ADAPTER_MODE,
    EVALUATION,
    AdapterMode,
    DPSettings,
    LocalTraining,
    NodeConfig,
    PrivacyUnit,
    Purpose,
    RunConfig,
)
from fedciuic.crypto import update_payload
from fedciuic.data import RegionData, load_region_data, node_commitment, oversized_details
from fedciuic.errors import FedciuicError
from fedciuic.model import AdapterModel, EvalStats, TrainStats, train_local
from fedciuic.policy import RegionPolicy
from fedciuic.privacy import (
    LEDGER_FILE,
    LedgerRound,
    PrivacyError,
    PrivacyLedger,
    Step,
    audit_witness,
    count_steps,
    dp_count,
    dp_mean,
    dp_mean_step,
    evaluations,
    locked,
    plan_private_steps,
    poisson_sample_rate,
    private_round,
    remembered_noise,
    run_prefix,
    warn_once,
)
from fedciuic.region.cache import BoundedCache
from fedciuic.releases import data_fields, kept, leaving
from fedciuic.secagg import sent_norm
from fedciuic.stages import AuditTrail
from fedciuic.wire import (
    ADAPTER_MODE,
    DEID_ENTITIES,
    JURISDICTION,
    POLICY_HASH,
    PRIVACY_UNIT,
    TRAINED,
    UPDATE,
    UPDATE_NORM,
    Instruction,
)


class BaseModelMismatch(FedciuicError):
    """The region's base model differs from the aggregator's."""


class AlreadyReleased(FedciuicError):
    """This round was released before and its update is gone: nothing is sent twice."""


class RoundOutOfRange(FedciuicError):
    """A round outside 1..num-server-rounds, which the noise is not calibrated for."""


_T = TypeVar("_T")

#: Opens a kept update's file: the region's record of the round, then the payload.
KEPT_MAGIC = b"fedciuic-kept/1\n"


class KeptUpdateError(FedciuicError):
    """A kept update that cannot be read back."""


@dataclass(frozen=True)
class Kept:
    """A released round's payload and its ``trained`` audit record (None if kept before)."""

    payload: bytes
    trained: dict[str, Any] | None


class SentUpdates:
    """The update a region released for each round of the current run, kept on its disk
    so that a restarted aggregator gets it again, not a second release (and charge)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "sent"

    def _path(self, run_id: int, server_round: int) -> Path:
        return self.dir / f"run-{run_id}-round-{server_round}.update"

    def load(self, run_id: int, server_round: int) -> Kept | None:
        path = self._path(run_id, server_round)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if not raw.startswith(KEPT_MAGIC):
            return Kept(raw, None)  # kept by an earlier version: the payload alone
        try:
            (size,) = struct.unpack_from("<I", raw, len(KEPT_MAGIC))
            start = len(KEPT_MAGIC) + 4
            record = json.loads(raw[start : start + size])
            payload = raw[start + size :]
            if not isinstance(record, dict) or not isinstance(record.get("trained"), dict):
                raise ValueError("no record of the release")
            if not set(record["trained"]) <= set(TRAINED_FIELDS):
                raise ValueError(f"a record of the release with fields {sorted(record['trained'])}")
            if record.get("sha256") != hashlib.sha256(payload).hexdigest():
                raise ValueError("the update does not match its checksum")
        except (struct.error, ValueError) as err:
            raise KeptUpdateError(
                f"{path}: unreadable kept update ({err}); it holds round {server_round}, "
                "which was released: without it this region sits that round out"
            ) from None
        return Kept(payload, record["trained"])

    def drop(self, run_id: int, server_round: int) -> None:
        """Forget an update that was kept but never released."""
        self._path(run_id, server_round).unlink(missing_ok=True)

    def save(self, run_id: int, server_round: int, kept: Kept) -> None:
        """Write before the release commits (fsync'ed); other runs' updates are dropped."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("run-*.update"):
            if not old.name.startswith(f"run-{run_id}-round-"):
                old.unlink(missing_ok=True)
        digest = hashlib.sha256(kept.payload).hexdigest()
        record = json.dumps({"trained": kept.trained or {}, "sha256": digest}).encode()
        target = self._path(run_id, server_round)
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            handle.write(KEPT_MAGIC + struct.pack("<I", len(record)) + record + kept.payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)


@dataclass(frozen=True)
class PrivacySpent:
    """What a DP round cost, as recorded in the region's ledger."""

    epsilon: float  # cumulative over the dataset's history, after this round
    epsilon_budget: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    secure_mode: bool
    max_grad_norm: float
    #: What one guarantee covers (the run's privacy-unit; the ledger accounts per it).
    unit: PrivacyUnit
    #: What this run has spent on its own after this round, and the cap it is held to.
    run_epsilon: float | None = None
    run_epsilon_cap: float | None = None
    #: Noise derived from the run config's seed (insecure-reproducible-noise, tests only).
    reproducible_noise: bool = False
    #: The ledger's head after this release, audited so a rolled-back ledger is refused.
    ledger: dict[str, Any] | None = None
    #: The run's DP count of units (count-noise), which the reply carries as its weight.
    count: int | None = None


#: A release's privacy as its ``trained`` audit record has it, in order.
RELEASED = (
    "epsilon",
    "unit",
    "epsilon_budget",
    "delta",
    "noise_multiplier",
    "sample_rate",
    "max_grad_norm",
    "run_epsilon",
    "ledger",  # witnesses the ledger's head (docs/privacy.md)
)


#: What a region's audit log records of a release (``trained``).
TRAINING_FIELDS = ("examples", "steps", "data_fingerprint", "size_of_data")
TRAINED_FIELDS = (*TRAINING_FIELDS, OUTSIDE_DP, *RELEASED)


def trained_record(outcome: TrainOutcome, outside_dp: list[str]) -> dict[str, Any]:
    """A release's :data:`TRAINED_FIELDS` (privacy figures None without DP), kept with the
    update so that a region stopped before noting it notes it when it resends."""
    stats = outcome.stats
    training = (stats.num_examples, stats.steps, outcome.data_fingerprint, outcome.size_of_data)
    record = dict(zip(TRAINING_FIELDS, training, strict=True)) | {OUTSIDE_DP: outside_dp}
    return record | {name: getattr(outcome.privacy, name, None) for name in RELEASED}


@dataclass(frozen=True)
class TrainOutcome:
    """What a region that took part sends back: its adapter delta and statistics."""

    region: str
    delta: dict[str, np.ndarray]
    stats: TrainStats
    data_fingerprint: str
    privacy: PrivacySpent | None = None
    update: bytes = b""  # the delta (plus the old residual) encoded with the run's codec
    #: What the delta's tensors are: the adapter-mode the region's model trains in.
    adapter_mode: AdapterMode = DEFAULT_ADAPTER_MODE
    #: The entity types scrubbed from the texts it trained on (none: not de-identified).
    deidentified: tuple[str, ...] = ()
    #: Whether the update's size depends on the data (a top-k codec's index coding).
    size_of_data: bool = False


def train_metrics(outcome: TrainOutcome) -> dict[str, int | float | list[int] | list[float]]:
    count = getattr(outcome.privacy, "count", None)  # the DP count, where the run has one
    metrics: dict[str, int | float | list[int] | list[float]] = {
        "num-examples": outcome.stats.num_examples if count is None else count,
        "steps": outcome.stats.steps,
        "update-bytes": len(outcome.update),
    }
    if math.isfinite(outcome.stats.loss):  # NaN: every step drew an empty batch
        metrics["train-loss"] = outcome.stats.loss
    if (p := outcome.privacy) is not None:
        metrics |= {
            "epsilon": p.epsilon,
            "epsilon-budget": p.epsilon_budget,
            "delta": p.delta,
            "noise-multiplier": p.noise_multiplier,
            "sample-rate": p.sample_rate,
            "secure-mode": int(p.secure_mode),
            "max-grad-norm": p.max_grad_norm,
        }
    return metrics


def update_norm(update: bytes, run: RunConfig) -> float:
    """The norm a secure round's reply carries: of the decoded update, clipped as the sum
    takes it (secagg.rotation.sent_norm)."""
    size = update_entries(update)
    values = run.compression.codec.decode(update, size).dense(size)
    return sent_norm(values, run.compression.max_update_norm)


def train_info(outcome: TrainOutcome, policy: RegionPolicy, commitment: str) -> dict[str, str]:
    """Who trained on what (``commitment``: to the data), under which policy."""
    return {
        "region": outcome.region,
        "status": TRAINED,
        "reason": "",
        "data-fingerprint": commitment,
        JURISDICTION: policy.jurisdiction,
        POLICY_HASH: policy.hash,
        PRIVACY_UNIT: getattr(outcome.privacy, "unit", ""),  # none without DP
        ADAPTER_MODE: outcome.adapter_mode,
        DEID_ENTITIES: ",".join(outcome.deidentified),
    }


def update_arrays(update: bytes) -> dict[str, np.ndarray]:
    """The compressed update as the one array a reply (or sealed payload) carries."""
    return {UPDATE: np.frombuffer(update, dtype=np.uint8)}


#: Distinguishes the rounding generator from anything else seeded with a round's seed.
ROUNDING_STREAM = 2


def rounding_rng(dp: DPSettings, seed: int) -> np.random.Generator:
    """The codec's rounding generator: seeded only where the round is reproducible anyway,
    so the aggregator (who picks the seed) cannot replay it. It costs no privacy (after DP)."""
    if dp.dp and not dp.insecure_reproducible_noise:
        return np.random.default_rng()
    return np.random.default_rng([seed, ROUNDING_STREAM])


def compress_update(
    delta: dict[str, np.ndarray],
    codec: Codec,
    state_dir: Path,
    rng: np.random.Generator,
    round_tag: str = "",
) -> bytes:
    """The delta encoded with error feedback (after DP: post-processing); the residual stays
    on disk per codec, with the one before ``round_tag``'s round for a round trained again."""
    vector = flatten(delta)
    safe = re.sub(r"[^a-z0-9.-]", "_", codec.name)
    layout = layout_id(layout_of(delta))
    feedback = ErrorFeedback(
        state_dir / f"residual-{safe}.bin", codec, layout, vector.size, round_tag
    )
    update, residual = compress_with_feedback(vector, feedback.load(), codec, rng, out=vector)
    feedback.save(residual)
    return update


def _seed(*parts: object) -> int:
    """A reproducible seed distinct per ``parts`` (the run's seed, the region, ...)."""
    key = ":".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


def run_cap(target_epsilon: float, max_run_epsilon: float | None) -> tuple[float, str]:
    """The per-run cap and where it is set: target-epsilon, or the policy's if lower."""
    if max_run_epsilon is not None and max_run_epsilon < target_epsilon:
        return max_run_epsilon, f"{max_run_epsilon:g} (privacy.max_epsilon_per_run)"
    return target_epsilon, f"{target_epsilon:g} (target-epsilon)"


class RegionLedger:
    """A region's privacy ledger: checked against its audit log's witness, locked in use."""

    def __init__(self, run: RunConfig, node: NodeConfig, data: RegionData) -> None:
        self.run, self.node, self.data, self.name = run, node, data, node.region

    @property
    def dp(self) -> DPSettings:
        return self.run.privacy

    @property
    def path(self) -> Path:
        return self.node.state_dir / LEDGER_FILE

    @property
    def audit_path(self) -> Path:
        return self.node.state_dir / REGION_LOG

    def step(self, ledger: PrivacyLedger | None = None, run_id: int | None = None) -> Step:
        """This run's per-round step at its most (the budget checks' worst case); with
        count-noise its rate follows from the run's DP count in ``ledger``."""
        dp, local = self.dp, self.run.training
        n = self.units(ledger, run_id)
        if dp.target_delta >= 1.0 / n:
            raise PrivacyError(
                f"run config:target-delta: {dp.target_delta:g} is not below 1/n = "
                f"{1.0 / n:.3g} for region {self.name}'s {n} training {dp.privacy_unit}s; "
                "choose a smaller delta"
            )
        rate = poisson_sample_rate(n, local.batch_size)
        planned = self.run.schedule.num_server_rounds * local.local_steps
        noise = remembered_noise(
            self.node.state_dir,
            run_prefix(dp, self.run.schedule.num_server_rounds),  # releases besides rounds
            dp.target_epsilon,
            dp.target_delta,
            rate,
            planned,
            dp.dp_accountant,
        )
        return (noise, rate, local.local_steps)

    @property
    def evaluations(self) -> int:
        """The DP evaluations this run may release."""
        return evaluations(self.dp, self.run.schedule.num_server_rounds)

    def units(self, ledger: PrivacyLedger | None, run_id: int | None) -> int:
        """The units the run samples from: the exact count, or its DP count (>= batch-size)."""
        n = self.data.train.num_units
        if not count_steps(self.dp):
            return n
        count = None if ledger is None or run_id is None else ledger.run_count(run_id)
        if count is None:
            raise PrivacyError(
                f"region {self.name}: run {run_id} has no DP count of its units in the ledger "
                "yet; it is released at the run's first training round"
            )
        return max(count, self.run.training.batch_size)

    def release_count(
        self, ledger: PrivacyLedger, *, run_id: int, server_round: int, audit: AuditTrail
    ) -> None:
        """With count-noise: the run's DP count of units, drawn once and committed before
        anything depends on it."""
        if not count_steps(self.dp) or ledger.run_count(run_id) is not None:
            return
        dp, (step,) = self.dp, count_steps(self.dp)
        units = self.data.train.num_units

        def draw(seed: int | None) -> int:
            return dp_count(units, dp.count_noise, secure_mode=dp.secure_mode, seed=seed)

        count, noted = self._release(
            ledger, step, run_id=run_id, server_round=server_round, purpose=COUNTS, draw=draw
        )
        audit.append(
            Event.UNITS_COUNTED,
            run_id=run_id,
            server_round=server_round,
            count=count,
            count_noise=dp.count_noise,
            **noted,
        )

    def _release(
        self,
        ledger: PrivacyLedger,
        step: Step,
        *,
        run_id: int,
        server_round: int,
        purpose: Purpose,
        draw: Callable[[int | None], _T],
    ) -> tuple[_T, dict[str, Any]]:
        """A release besides a round's update, committed as its own ledger line before
        anything uses it (``draw`` gets a seed only under insecure-reproducible-noise);
        returns it and what its witnessing audit record notes."""
        dp = self.dp
        budget = self.node.epsilon_budget or dp.epsilon_budget
        cap = run_cap(dp.target_epsilon, None)
        after, _ = ledger.admit(
            step, budget=budget, run_id=run_id, server_round=server_round, cap=cap
        )
        seed = None
        if dp.insecure_reproducible_noise:
            seed = _seed(self.run.model.seed, self.name, purpose, len(ledger.rounds))
        value = draw(seed)
        record = ledger.new_record(
            run_id=run_id,
            server_round=server_round,
            step=step,
            # the sensitivity in the noise's units: a count's 1, a loss's clip
            max_grad_norm=dp.eval_loss_clip if purpose == EVALUATION else 1.0,
            secure_mode=dp.secure_mode,
            epsilon=after,
            reproducible_noise=dp.insecure_reproducible_noise,
            purpose=purpose,
            count=value if purpose == COUNTS else None,  # type: ignore[arg-type]
        )
        ledger.append(record)  # the commit, then its witness (as for a round's release)
        noted = {"epsilon": after, "data_fingerprint": self.data.fingerprint}
        return value, {**noted, "ledger": ledger.witness_record()}

    @contextlib.contextmanager
    def session(self, held: PrivacyLedger | None = None) -> Iterator[PrivacyLedger]:
        """The dataset's ledger, locked while the block runs (``held``: one already held)."""
        if held is not None:
            yield held
            return
        with locked(self.path):
            yield self._open()

    def evaluate(
        self, losses: list[float], *, run_id: int, server_round: int
    ) -> tuple[float, int, dict[str, object]]:
        """A DP held-out loss from each unit's ``losses``, charged as its own release."""
        dp, step = self.dp, dp_mean_step(self.dp.eval_noise)
        with self.session() as ledger:
            done = ledger.run_releases(run_id, EVALUATION)
            if done >= self.evaluations:
                raise PrivacyError(
                    f"region {self.name}: run {run_id} has released its {done} DP "
                    f"evaluations (num-server-rounds + 2, what its noise leaves room for); "
                    "this one is declined and nothing is sent"
                )

            def draw(seed: int | None) -> tuple[float, int]:
                clip, noise, secure = dp.eval_loss_clip, dp.eval_noise, dp.secure_mode
                return dp_mean(losses, clip, noise, secure_mode=secure, seed=seed)

            (loss, count), noted = self._release(
                ledger,
                step,
                run_id=run_id,
                server_round=server_round,
                purpose=EVALUATION,
                draw=draw,
            )
            return loss, count, {**noted, "eval_noise": dp.eval_noise}

    def projected(
        self, ledger: PrivacyLedger | None = None, run_id: int | None = None
    ) -> float | None:
        """The dataset's cumulative epsilon if it trains one more round (None without DP)."""
        if not self.dp.dp:
            return None
        with self.session(ledger) as held:
            return held.epsilon_after(self.step(held, run_id))

    def _open(self) -> PrivacyLedger:
        return PrivacyLedger.open(
            self.path,
            region=self.name,
            dataset=self.data.fingerprint,
            delta=self.dp.target_delta,
            accountant=self.dp.dp_accountant,
            unit=self.dp.privacy_unit,
            witness=audit_witness(self.audit_path, region=self.name, dataset=self.data.fingerprint),
        )


class Region:
    """A region's model and data, loaded from its own data-path only."""

    def __init__(self, run: RunConfig, node: NodeConfig) -> None:
        self.run, self.node, self.name = run, node, node.region
        if run.privacy.noise_warning:
            warn_once(run.privacy.noise_warning)
        check_sharding(run, node)
        # A sharded base is never whole here: each training process reads its slice.
        self.model = AdapterModel(node.model_spec(run), skeleton=node.sharded(run))
        #: The run's local training, with the region's own physical batch.
        self.local: LocalTraining = node.training(run)
        logging.getLogger("flwr").info("fedciuic: region %s: %s", self.name, self.model.describe())
        self.data: RegionData = load_region_data(run, node, self.model.tokenizer)
        self.ledger = RegionLedger(run, node, self.data)
        #: With train-processes > 1: the training processes, kept across rounds.
        self._cluster: TrainingCluster | None = None
        self._step_seconds: float | None = None

    @property
    def dp(self) -> DPSettings:
        return self.run.privacy

    @property
    def slowdown(self) -> float:
        """How many times slower this region trains (test-region-slowdown; tests only)."""
        return self.run.training.slowdown(self.name)

    @property
    def processes(self) -> int:
        """How many processes train this region's rounds (node config wins)."""
        return self.node.processes(self.run)

    def _train_cluster(self, command: TrainCommand) -> ClusterStats:
        return self._on_cluster(lambda cluster: cluster.train(command))

    def _forward(self, op: ForwardOp, noise_multiplier: float = 1.0) -> Any:
        """Forward-only work: here, or on every process of a sharded base (each a slice)."""
        command = TrainCommand(op=op, slowdown=self.slowdown, noise_multiplier=noise_multiplier)
        if self.node.sharded(self.run):
            return self._on_cluster(lambda cluster: cluster.forward(command))
        return forward_work(self.model, self.data, self.local, self.dp, command)

    def _on_cluster(self, work: Callable[[TrainingCluster], _T]) -> _T:
        if self._cluster is None:
            self._cluster = TrainingCluster(self.run, self.node, self.model, self.data)
        try:
            return work(self._cluster)
        except BaseException:
            self._cluster = None  # torn down by it; the next round builds a new one
            raise

    def close(self) -> None:
        """Stop the region's training processes, if any (they also die with us)."""
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def _load_global(self, adapter: dict[str, np.ndarray], base_fingerprint: str) -> None:
        if base_fingerprint != self.model.base_fingerprint:
            raise BaseModelMismatch(
                f"region {self.name}: base model fingerprint {self.model.base_fingerprint[:12]} "
                f"differs from the aggregator's {base_fingerprint[:12]}; every party must use "
                "the same model-preset and seed, or the same model-path checkpoint"
            )
        self.model.load_adapter_state(adapter)

    def train_round(
        self,
        adapter: dict[str, np.ndarray],
        *,
        server_round: int,
        base_fingerprint: str,
        run_id: int = 0,
        max_run_epsilon: float | None = None,
        ledger: PrivacyLedger | None = None,
        keep: Callable[[TrainOutcome], None] | None = None,
    ) -> TrainOutcome:
        """Train from the global adapter and return ``local - global`` with statistics.

        With DP the ledger is locked for the whole round. ``keep`` writes the outcome to
        disk before the ledger records the release (the commit): a region stopped at any
        point either has no record and trains again, or has both and resends.
        """
        self.check_round(server_round)
        self._load_global(adapter, base_fingerprint)
        start = self.model.adapter_state()
        seed = _seed(self.run.model.seed, self.name, server_round)  # sampling per round
        with self.ledger.session(ledger) if self.dp.dp else contextlib.nullcontext() as held:
            if held is None:
                stats, privacy, record = self._train_clear(server_round, seed), None, None
            else:
                stats, privacy, record = self._train_private(
                    server_round, run_id, seed, max_run_epsilon, held
                )
            end = self.model.adapter_state()
            delta = {name: end[name] - start[name] for name in start}
            update = compress_update(
                delta,
                self.run.compression.codec,
                self.node.state_dir,
                rounding_rng(self.dp, seed),
                round_tag=f"run-{run_id}-round-{server_round}",
            )
            outcome = TrainOutcome(
                self.name,
                delta,
                stats,
                self.data.fingerprint,
                privacy,
                update,
                self.model.spec.adapter_mode,
                self.data.deidentified,
                self.run.compression.codec.sparse,
            )
            if keep is not None:
                keep(outcome)
            if held is not None and record is not None:  # record: a DP round's, under held
                held.append(record)  # the commit: fsync'ed before anything is released
        return outcome

    def _train_clear(self, server_round: int, seed: int) -> TrainStats:
        local = self.local
        if self.processes > 1:
            command = TrainCommand(
                server_round=server_round,
                seed=seed,
                steps=local.local_steps,
                time_budget=local.local_time_budget,
                slowdown=self.slowdown,
            )
            return self._train_cluster(command).stats
        return train_local(
            self.model,
            self.data.train,
            steps=local.local_steps,
            batch_size=local.batch_size,
            learning_rate=local.learning_rate,
            generator=torch.Generator().manual_seed(seed),
            optimizer=local.optimizer,
            time_budget=local.local_time_budget,
            slowdown=self.slowdown,
            proximal_mu=local.proximal_mu,
        )

    @property
    def ledger_path(self) -> Path:
        return self.ledger.path

    def privacy_step(self, ledger: PrivacyLedger | None = None, run_id: int | None = None) -> Step:
        return self.ledger.step(ledger, run_id)

    def check_round(self, server_round: int) -> None:
        last = self.run.schedule.num_server_rounds
        if not 1 <= server_round <= last:
            raise RoundOutOfRange(
                f"region {self.name}: round {server_round} is outside this run's rounds 1..{last} "
                f"(run config num-server-rounds = {last}); the noise is calibrated for {last} "
                "round(s), so nothing is trained or sent for it"
            )

    @property
    def audit_path(self) -> Path:
        return self.ledger.audit_path

    def projected_epsilon(
        self, ledger: PrivacyLedger | None = None, run_id: int | None = None
    ) -> float | None:
        return self.ledger.projected(ledger, run_id)

    def _train_private(
        self,
        server_round: int,
        run_id: int,
        seed: int,
        max_run_epsilon: float | None,
        ledger: PrivacyLedger,
    ) -> tuple[TrainStats, PrivacySpent, LedgerRound]:
        """DP-SGD under the budget checks, and the record that will commit the release."""
        dp = self.dp
        budget = self.node.epsilon_budget or dp.epsilon_budget
        step = self.privacy_step(ledger, run_id)
        cap = run_cap(dp.target_epsilon, max_run_epsilon)
        after, run_after = ledger.admit(
            step, budget=budget, run_id=run_id, server_round=server_round, cap=cap
        )
        reproducible = dp.insecure_reproducible_noise
        # Planned from a synthetic step, never a clock stop (docs/privacy.md).
        planned = plan_private_steps(self.local, partial(self._forward, "time", step[0]))
        released: Step = (step[0], step[1], planned)
        units = self.ledger.units(ledger, run_id) if count_steps(self.dp) else None
        stats, taken = self._train_dp(server_round, seed, released, units)
        if taken != (planned, planned) or stats.steps != planned:
            raise PrivacyError(
                f"region {self.name}: {taken[0]} to {taken[1]} DP-SGD steps were taken "
                f"(over {self.processes} training process(es)), {planned} were planned "
                "and would be accounted; the update is not released"
            )
        if planned != step[2]:  # fewer steps than the worst case checked: less epsilon
            after = ledger.epsilon_after(released)
            run_after = ledger.run_epsilon_after(run_id, released)
        record = ledger.new_record(
            run_id=run_id,
            server_round=server_round,
            step=released,
            max_grad_norm=dp.max_grad_norm,
            secure_mode=dp.secure_mode,
            epsilon=after,
            reproducible_noise=reproducible,
        )
        privacy = PrivacySpent(
            epsilon=after,
            epsilon_budget=budget,
            delta=dp.target_delta,
            noise_multiplier=step[0],
            sample_rate=step[1],
            secure_mode=dp.secure_mode,
            max_grad_norm=dp.max_grad_norm,
            unit=dp.privacy_unit,
            run_epsilon=run_after,
            run_epsilon_cap=cap[0],
            reproducible_noise=reproducible,
            ledger=ledger.witness_record(record),  # once the record is appended
            count=units,
        )
        return stats, privacy, record

    def _train_dp(
        self, server_round: int, seed: int, step: Step, units: int | None = None
    ) -> tuple[TrainStats, tuple[int, int]]:
        """DP-SGD for ``step`` here or over the cluster; with the fewest and most steps taken."""
        if self.processes > 1:
            command = TrainCommand(
                server_round=server_round,
                seed=seed,
                dp=True,
                steps=step[2],
                noise_multiplier=step[0],
                sample_rate=step[1],
                units=units or 0,
                slowdown=self.slowdown,
            )
            done = self._train_cluster(command)
            return done.stats, (done.fewest_steps, done.most_steps)
        ran = private_round(
            self.model,
            self.data.train,
            self.local,
            self.dp,
            noise_multiplier=step[0],
            sample_rate=step[1],
            steps=step[2],
            seed=seed,
            who=f"region {self.name}",
            slowdown=self.slowdown,
            units=units,
        )
        return ran.stats, (ran.steps_taken, ran.steps_taken)

    def evaluate(
        self,
        adapter: dict[str, np.ndarray],
        *,
        base_fingerprint: str,
        run_id: int = 0,
        server_round: int = 0,
        step_seconds: bool = True,
    ) -> EvalStats:
        """Held-out loss of the global adapter on the region's evaluation blocks, exact or
        (with eval-noise) a DP release; ``step_seconds`` False: no step timed (withheld)."""
        self._load_global(adapter, base_fingerprint)
        stats: EvalStats
        if not self.ledger.evaluations:
            stats = self._forward("evaluate")
        else:
            loss, count, released = self.ledger.evaluate(
                self._forward("losses"), run_id=run_id, server_round=server_round
            )
            stats = EvalStats(loss, count, None, released)
        return replace(stats, step_seconds=self.step_seconds() if step_seconds else None)

    def step_seconds(self) -> float | None:
        """One DP-SGD step's seconds, timed once (None without DP): the aggregator sizes
        its wait on it (docs/heterogeneity.md)."""
        if not self.dp.dp:
            return None
        if self._step_seconds is None:
            self._step_seconds = self._forward("time")
        return self._step_seconds


@dataclass(frozen=True)
class Released:
    """A round's update as it leaves, and whether it is the kept one sent again."""

    payload: bytes
    resent: bool = False


class Release:
    """One training round's release; a round released before sends its kept update again.
    :meth:`open` it once the instruction is checked, :meth:`project`, then :meth:`send`."""

    def __init__(
        self,
        region: Region,
        audit: AuditTrail,
        sent: SentUpdates,
        kept: Kept | None,
        *,
        run_id: int,
        server_round: int,
        ledger: PrivacyLedger | None,
    ) -> None:
        self.region, self.audit, self.sent, self.ledger = region, audit, sent, ledger
        self.run_id, self.server_round = run_id, server_round
        if kept is not None and ledger is not None and not self.released():
            # Kept, then the region stopped before the ledger recorded it (the
            # commit): it never left, so it is dropped and the round trained again.
            sent.drop(run_id, server_round)
            kept = None
        self.kept = kept

    @property
    def counts(self) -> bool:
        """Whether this round first releases the run's DP count (the policy goes first)."""
        return (
            self.kept is None
            and self.ledger is not None
            and bool(count_steps(self.region.dp))
            and self.ledger.run_count(self.run_id) is None
        )

    def project(self) -> float | None:
        """The dataset's epsilon if it trains this round (None without DP or when
        resending); with count-noise the run's DP count is released first."""
        if self.kept is not None or self.ledger is None:
            return None
        self.region.ledger.release_count(
            self.ledger, run_id=self.run_id, server_round=self.server_round, audit=self.audit
        )
        return self.region.projected_epsilon(self.ledger, self.run_id)

    @classmethod
    @contextlib.contextmanager
    def open(
        cls, region: Region, audit: AuditTrail, *, run_id: int, server_round: int
    ) -> Iterator[Release]:
        """The round's release; with DP, one ledger for the round, opened and locked once."""
        sent = SentUpdates(region.node.state_dir)
        kept = sent.load(run_id, server_round)
        with region.ledger.session() if region.dp.dp else contextlib.nullcontext() as ledger:
            yield cls(
                region, audit, sent, kept, run_id=run_id, server_round=server_round, ledger=ledger
            )

    def note(self, event: str, **details: object) -> None:
        self.audit.append(event, run_id=self.run_id, server_round=self.server_round, **details)

    def released(self) -> bool:
        """Whether the ledger already records this round of this run (DP runs only)."""
        region = self.region
        if not region.dp.dp or (self.ledger is None and not region.ledger_path.exists()):
            return False
        with region.ledger.session(self.ledger) as held:
            return held.released(self.run_id, self.server_round)

    def send(self, task: Instruction, policy: RegionPolicy) -> Released:
        """The round's update: the kept one again, or trained now and released;
        :class:`AlreadyReleased` when the ledger records it and it is gone."""
        region = self.region
        if self.kept is not None:  # the same update again, no second charge
            if self.kept.trained is not None and not self._noted_trained():
                self._note_trained(self.kept.trained)  # stopped before noting it
            return Released(self.kept.payload, resent=True)
        if self.released():
            raise AlreadyReleased(
                f"region {region.name}: round {self.server_round} of run {self.run_id} was "
                "already released (the privacy ledger records it) and its update was not "
                "kept; nothing is released twice, so this region sits out the round"
            )
        if (deid := region.data.summary.deid) is not None:  # what the texts were scrubbed of
            self.note(Event.DATA_DEIDENTIFIED, **deid.model_dump())
        if (oversized := oversized_details(region.data.summary)) is not None:  # records unread
            self.note(Event.RECORDS_OVERSIZED, **oversized)
        payload, outside_dp = b"", []

        def keep(trained: TrainOutcome) -> None:
            """On disk before the ledger commits the release (resent after a restart)."""
            nonlocal payload, outside_dp
            commitment = node_commitment(region.node, trained.data_fingerprint, self.run_id)
            info = train_info(trained, policy, commitment)
            run, dp_only = region.run, policy.dp_only
            released = train_metrics(trained)
            if run.secure_norms:  # the secure sum's scale follows the regions' norms
                released[UPDATE_NORM] = update_norm(trained.update, run)
            metrics = kept(TRAINED, released, run, dp_only=dp_only)
            arrays = update_arrays(trained.update)
            fields = {**metrics, **info, **arrays}
            leaving(TRAINED, fields, run, dp_only=dp_only, who=f"region {region.name}")
            outside_dp = data_fields(TRAINED, fields, run)
            payload = update_payload(arrays, metrics, info)
            record = trained_record(trained, outside_dp)
            self.sent.save(self.run_id, self.server_round, Kept(payload, record))

        outcome = region.train_round(
            task.adapter,
            server_round=self.server_round,
            base_fingerprint=task.base_fingerprint,
            run_id=self.run_id,
            max_run_epsilon=policy.max_epsilon_per_run,
            ledger=self.ledger,
            keep=keep,
        )
        self._note_trained(trained_record(outcome, outside_dp))
        return Released(payload)

    def _note_trained(self, record: dict[str, Any]) -> None:
        self.note(Event.TRAINED, **record)

    def _noted_trained(self) -> bool:
        """Whether the audit log records this round's release of this run."""
        path = self.audit.path
        if path is None or not path.exists():
            return False
        return any(
            r.get("event") == Event.TRAINED
            and r.get("run_id") == self.run_id
            and r.get("round") == self.server_round
            for r in load_records(path)
        )


#: This process's built regions, bounded by count and private memory (region_cache).
REGIONS: BoundedCache[Region] = BoundedCache(
    lambda region: region.model.private_bytes(), close=Region.close
)


def open_region(run: RunConfig, node: NodeConfig) -> Region:
    """The region for this run and node config, built once while the cache keeps it."""
    return REGIONS.get((run, node), lambda: Region(run, node))
