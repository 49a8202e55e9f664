"""The aggregator's run around its rounds, without Flower: the audit log, the keys and
policies it holds (cross-checked), a resume from a checkpoint, ``run_start``, and the
run's end."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from pathlib import Path

from fedciuic.aggregator.checkpoint import (
    CHECKPOINT_DIR,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
)
from fedciuic.aggregator.round import AggregatorRound
from fedciuic.aggregator.server_optim import OptimizerStateError, ServerOptimizer
from fedciuic.audit import (
    AGGREGATOR_LOG,
    AuditLog,
    Event,
    code_version,
    config_hash,
    enforce_at_start,
)
from fedciuic.compression import layout_of
from fedciuic.config import RunConfig
from fedciuic.crypto import AggregatorKeys, aggregator_keys, model_digest
from fedciuic.errors import FedciuicError
from fedciuic.model import AdapterLayout
from fedciuic.policy import AggregatorPolicies, PolicyError
from fedciuic.record import (
    ADAPTER_DIR,
    PolicyHeld,
    ResumedFrom,
    RunRecorder,
    RunStatus,
    no_aggregate_reasons,
    published_rounds,
)
from fedciuic.stages import ReplySealing, aggregator_sealing

# Flower's logger, by name: these lines show with the rest of the run's output.
_logger = logging.getLogger("flwr")


def warn_disabled(run: RunConfig) -> None:
    """Say which protections this run goes without."""
    if not run.sealing.seal:
        _logger.log(WARNING, "fedciuic: sealing is OFF: updates cross the relay in the clear")
    if not run.privacy.dp:
        _logger.log(
            WARNING, "fedciuic: DP is OFF: regions send updates without differential privacy"
        )
    elif run.privacy.noise_warning:
        _logger.log(WARNING, run.privacy.noise_warning)


def aggregator_log(run: RunConfig) -> AuditLog:
    """The aggregator's audit log, paths redacted unless its own policy says otherwise."""
    dirs = {"keys-dir": run.sealing.keys_dir, "policies-dir": run.policy.policies_dir}
    redact = [(str(run.output.output_path), "<output-dir>")]
    redact += [(d, f"<{name}>") for name, d in dirs.items() if d]
    return AuditLog(run.output.audit_path / AGGREGATOR_LOG, "aggregator", None, redact=redact)


def held_policies(
    run: RunConfig, keys: AggregatorKeys | None, recorder: RunRecorder
) -> AggregatorPolicies | None:
    """Every region's policy, as the aggregator holds them; None only for a lab baseline."""
    where = run.policy
    if not where.enforce_policies:
        _logger.log(
            WARNING, "fedciuic: policies are OFF (enforce-policies = false): a lab baseline only"
        )
        recorder.data.run.policies = None
        return None
    if keys is not None and keys.keypair.bundle.jurisdiction != where.aggregator_jurisdiction:
        raise PolicyError(
            f"run config:aggregator-jurisdiction: {where.aggregator_jurisdiction}, but the "
            f"aggregator's key says {keys.keypair.bundle.jurisdiction}; regions judge where the "
            "aggregator sits by its key: make them agree"
        )
    policies = AggregatorPolicies.load(run)
    for problem in policies.policies.problems:
        _logger.log(
            WARNING,
            "fedciuic: unreadable policy, its region's updates will be rejected: %s",
            problem,
        )
    recorder.data.run.policies = {
        j: PolicyHeld(file=str(p.path), hash=p.hash)
        for j, p in sorted(policies.policies.by_jurisdiction.items())
    }
    return policies


def resume(
    run: RunConfig, base_fingerprint: str, audit: AuditLog, recorder: RunRecorder
) -> Checkpoint | None:
    """The checkpoint to resume from, checked against its signer, this model and the log."""
    if not run.output.resume_from:
        return None
    signer = audit.keypair.bundle if audit.keypair is not None else None
    checkpoint = load_checkpoint(Path(run.output.resume_from).expanduser(), signer)
    if checkpoint.base_fingerprint != base_fingerprint:
        raise CheckpointError(
            f"run config:resume-from: {run.output.resume_from} was trained on another base model "
            f"({checkpoint.base_fingerprint[:12]}, this one is {base_fingerprint[:12]}); use "
            "the same model-preset and seed, or the same model-path"
        )
    if checkpoint.adapter_mode != run.model.adapter_mode:
        raise CheckpointError(
            f"run config:adapter-mode: {run.model.adapter_mode!r}, but resume-from "
            f"{run.output.resume_from} holds an adapter trained in "
            f"{checkpoint.adapter_mode!r} (other tensors); resume it with adapter-mode = "
            f"{checkpoint.adapter_mode!r} or start a new run"
        )
    if checkpoint.round >= run.schedule.num_server_rounds:
        raise CheckpointError(
            f"run config:resume-from: {run.output.resume_from} has completed round "
            f"{checkpoint.round} of {run.schedule.num_server_rounds}; nothing is left to resume"
        )
    audit.check_continues(checkpoint.audit_seq, checkpoint.audit_head)
    recorder.data.rounds = checkpoint.rounds
    recorder.data.run.resumed_from = ResumedFrom(
        federation_run=checkpoint.federation_run,
        round=checkpoint.round,
        checkpoint=run.output.resume_from,
    )
    _logger.log(
        INFO,
        "fedciuic: resuming run %d after round %d (%s)",
        checkpoint.federation_run,
        checkpoint.round,
        run.output.resume_from,
    )
    return checkpoint


def run_start(
    audit: AuditLog,
    run_id: int,
    flower_run: int,
    run: RunConfig,
    sealing: ReplySealing,
    policies: AggregatorPolicies | None,
    resumed: Checkpoint | None,
    base_fingerprint: str = "",
) -> None:
    where, dp = run.policy, run.privacy
    own = policies.policies.get(where.aggregator_jurisdiction) if policies else None
    held = sorted(policies.policies.by_jurisdiction.items()) if policies else None
    if own is not None and not own.policy.audit.redact_paths:
        audit.redact = ()
    audit.append(
        Event.RUN_START,
        run_id=run_id,
        config_hash=config_hash(run.flat()),
        code_version=code_version(),
        regions=list(run.regions),
        aggregator_jurisdiction=where.aggregator_jurisdiction,
        relay_jurisdiction=where.relay,
        **sealing.run_start(),
        policy_hashes={j: p.hash for j, p in held} if held is not None else None,
        flower_run=flower_run,
        resumed_after_round=resumed.round if resumed else None,
        # Which checkpoint it continued from (its identity, and the key that signed it).
        checkpoint=(
            {"identity": resumed.identity, "round": resumed.round, "signer": resumed.signer}
            if resumed
            else None
        ),
        # What a compliance officer signs for: the model, and the DP terms asked.
        base_fingerprint=base_fingerprint,
        model=run.model.model_preset
        if not run.model.model_path
        else Path(run.model.model_path).name,
        dp={
            "on": dp.dp,
            "target_epsilon": dp.target_epsilon,
            "target_delta": dp.target_delta,
            "max_grad_norm": dp.max_grad_norm,
            "unit": dp.privacy_unit,
            "secure_mode": dp.secure_mode,
        },
        retention_days=(
            {j: p.policy.audit.retention_days for j, p in held} if held is not None else None
        ),
    )


def server_optimizer(run: RunConfig, resumed: Checkpoint | None) -> ServerOptimizer:
    """This run's server optimiser, fresh or continuing the checkpoint's state (none is
    refused unless ``none``: moments would silently restart from zero)."""
    if resumed is None:
        return ServerOptimizer(run.server)
    where = run.output.resume_from or "the checkpoint"
    if resumed.optimizer is None:
        if run.server.server_optimizer == "none":
            return ServerOptimizer(run.server)
        raise CheckpointError(
            f'run config:server-optimizer: "{run.server.server_optimizer}", but resume-from '
            f"{where} is a checkpoint without server optimizer state (fedciuic-checkpoint/1); "
            'resume it with server-optimizer = "none" or start a new run'
        )
    if resumed.optimizer.name != run.server.server_optimizer:
        raise CheckpointError(
            f'run config:server-optimizer: "{run.server.server_optimizer}", but resume-from '
            f'{where} continues a "{resumed.optimizer.name}" run; resume it with '
            f'server-optimizer = "{resumed.optimizer.name}" or start a new run'
        )
    try:
        optimizer = ServerOptimizer.from_state(
            run.server, resumed.optimizer, layout_of(resumed.adapter)
        )
    except OptimizerStateError as err:
        raise CheckpointError(f"run config:resume-from: {where}: {err}") from None
    changed = {
        k: (v, optimizer.hyperparameters[k])
        for k, v in resumed.optimizer.hyperparameters.items()
        if optimizer.hyperparameters.get(k) != v
    }
    if changed:  # allowed (a schedule), but the run no longer repeats the killed one
        _logger.log(
            WARNING,
            "fedciuic: resuming %s with other server optimizer settings: %s",
            run.server.server_optimizer,
            ", ".join(f"{k} {a:g} -> {b:g}" for k, (a, b) in sorted(changed.items())),
        )
    return optimizer


def restore(
    aggregator: AggregatorRound, resumed: Checkpoint, optimizer: ServerOptimizer | None = None
) -> None:
    """The checkpoint's server optimiser state (``optimizer``, if made) and schedule."""
    aggregator.server_optimizer = optimizer or server_optimizer(aggregator.run, resumed)
    aggregator.restore_schedule(resumed.extra)
    aggregator.resumed_from = resumed.identity


@dataclass(frozen=True)
class OpenedRun:
    """A run ready for its rounds: the aggregator's round, and where it starts."""

    aggregator: AggregatorRound
    resumed: Checkpoint | None

    @property
    def first_round(self) -> int:
        return self.resumed.round + 1 if self.resumed else 1


def open_run(
    run: RunConfig, flower_run: int, audit: AuditLog, recorder: RunRecorder, base_fingerprint: str
) -> OpenedRun:
    """Keys, policies, a resume, ``run_start``: the aggregator's round for this run."""
    sealed = run.sealing
    keys = (
        aggregator_keys(sealed.keys_dir, run.compression.max_update_bytes) if sealed.seal else None
    )
    audit.keypair = keys.keypair if keys else None
    policies = held_policies(run, keys, recorder)
    resumed = resume(run, base_fingerprint, audit, recorder)
    optimizer = server_optimizer(run, resumed)  # refused before run_start if it does not fit
    # The aggregator's log is kept by its own jurisdiction's policy (docs/audit.md).
    own = policies.policies.get(run.policy.aggregator_jurisdiction) if policies else None
    enforce_at_start(audit, own, _logger, "aggregator")
    federation_run = resumed.federation_run if resumed else flower_run
    sealing = aggregator_sealing(keys)
    run_start(audit, federation_run, flower_run, run, sealing, policies, resumed, base_fingerprint)
    aggregator = AggregatorRound(
        run,
        base_fingerprint=base_fingerprint,
        recorder=recorder,
        sealing=sealing,
        policies=policies,
        audit=audit,
        run_id=flower_run,
        federation_run=federation_run,
        checkpoints=recorder.directory / CHECKPOINT_DIR,
    )
    if resumed is not None:
        restore(aggregator, resumed, optimizer)
    return OpenedRun(aggregator, resumed)


@dataclass(frozen=True)
class Ended:
    status: RunStatus  # RunStatus.COMPLETED or RunStatus.NO_AGGREGATE
    adapter: str | None  # where the final adapter was saved


def end_run(aggregator: AggregatorRound, audit: AuditLog, layout: AdapterLayout) -> Ended:
    """``run_end`` in the audit log, signed; the final adapter saved only when some round
    published, else an untrained model would pass as the result."""
    final = model_digest(aggregator.global_adapter).hex()
    published = published_rounds(aggregator.recorder.data)
    status = RunStatus.COMPLETED if published else RunStatus.NO_AGGREGATE
    adapter = None
    if status == RunStatus.COMPLETED:
        directory = aggregator.recorder.directory / ADAPTER_DIR
        adapter = str(layout.save(aggregator.global_adapter, directory))
    audit.append(Event.RUN_END, run_id=aggregator.federation_run, status=status, model_digest=final)
    audit.checkpoint(run_id=aggregator.federation_run)
    return Ended(status, adapter)


def finish_run(recorder: RunRecorder, ended: Ended) -> None:
    """The final status in metrics.json, and the run's summary (the recorder's) in the log."""
    level = INFO
    if ended.status == RunStatus.NO_AGGREGATE:
        # The launchers (`fedciuic simulate`, run.sh) read this status and exit 3.
        recorder.finish(
            RunStatus.NO_AGGREGATE, adapter=None, reasons=no_aggregate_reasons(recorder.data)
        )
        level = WARNING
    else:
        recorder.finish(RunStatus.COMPLETED, adapter=ended.adapter)
    if recorder.summary is not None:
        for line in recorder.summary(recorder.data).splitlines():
            _logger.log(level, "%s", line)


def run_failed(
    recorder: RunRecorder, audit: AuditLog | None, run_id: int, err: FedciuicError
) -> None:
    """A fedciuic error ended the run: in metrics.json and (best effort) the audit log."""
    recorder.finish(RunStatus.FAILED, error=str(err))
    _logger.log(ERROR, "fedciuic: %s", err)
    if audit is None:
        return
    try:
        audit.append(Event.RUN_END, run_id=run_id, status=RunStatus.FAILED, error=str(err))
        audit.checkpoint(run_id=run_id)
    except FedciuicError as audit_err:  # the run has failed already; say so, go on
        _logger.log(ERROR, "fedciuic: cannot write the audit log: %s", audit_err)


def stopped(recorder: RunRecorder, reason: str) -> None:
    """Mark the run interrupted (metrics.json only: the log is the interrupted thread's)."""
    problem: Exception | None = None
    for _ in range(3):  # the run's thread may be changing the record right now
        try:
            if recorder.finish_unless_finished(RunStatus.INTERRUPTED, error=reason):
                _logger.log(WARNING, "fedciuic: run %s", reason)
            return
        except (RuntimeError, OSError) as err:
            problem = err
    _logger.log(ERROR, "fedciuic: cannot mark the run interrupted: %s", problem)


def crashed(recorder: RunRecorder, err: BaseException) -> None:
    """Not a fedciuic error: a signal's SystemExit, or a bug. Say so in metrics.json."""
    if isinstance(err, KeyboardInterrupt | SystemExit):
        stopped(recorder, f"stopped ({type(err).__name__}) before it ended")
    else:
        recorder.finish_unless_finished(RunStatus.FAILED, error=f"{type(err).__name__}: {err}")
