"""ServerApp: build the model and the strategy from the run config, run, save the results."""

from __future__ import annotations

from logging import ERROR, INFO, WARNING
from pathlib import Path

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from flwr.supercore.exit import add_exit_handler

from fedciuic.audit.log import AGGREGATOR_LOG, AuditLog, code_version, config_hash
from fedciuic.config import RunConfig
from fedciuic.crypto.sealing import AggregatorKeys, aggregator_keys, model_digest
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.model.adapter import AdapterModel, ModelSpec
from fedciuic.ops.outputs import (
    ADAPTER_DIR,
    COMPLETED,
    FAILED,
    INTERRUPTED,
    NO_AGGREGATE,
    RunRecorder,
    no_aggregate_reasons,
    published_rounds,
    summarize,
)
from fedciuic.policy.binding import AggregatorPolicies
from fedciuic.policy.rules import PolicyError
from fedciuic.rounds.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from server.strategy import RegionalFedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run = RunConfig.from_user_config(context.run_config, source="run config")
    except FedciuicError as err:
        log(ERROR, "fedciuic: %s", err)
        raise SystemExit(1) from None
    out_dir = run.output_path / f"run-{context.run_id}"
    recorder = RunRecorder(
        out_dir,
        {
            "run_id": context.run_id,
            "regions": list(run.regions),
            "config": run.model_dump(by_alias=True, mode="json"),
            "output_dir": str(out_dir),
        },
    )
    log(INFO, "fedciuic: writing this run to %s", out_dir)
    # SIGINT/SIGTERM: Flower runs its exit handlers, then exits; the run is then
    # "interrupted", never "running" forever. (After a normal end it changes nothing.)
    add_exit_handler(
        lambda: _stopped(recorder, "stopped by a signal (SIGINT/SIGTERM) before it ended"),
        run_before_force_exit=True,
    )
    if not run.seal:
        log(WARNING, "fedciuic: sealing is OFF: updates cross the relay in the clear")
    if not run.dp:
        log(WARNING, "fedciuic: DP is OFF: regions send updates without differential privacy")
    elif run.noise_warning:
        log(WARNING, run.noise_warning)
    audit = None
    try:
        audit = _audit_log(run)
        recorder.data["run"]["audit_log"] = str(audit.path)  # also for a run that fails
        model = AdapterModel(ModelSpec.from_run(run), device=torch.device("cpu"))
        recorder.data["run"]["base_fingerprint"] = model.base_fingerprint
        keys = aggregator_keys(run.keys_dir, run.max_update_bytes) if run.seal else None
        audit.keypair = keys.keypair if keys else None
        policies = _policies(run, keys, recorder)
        resumed = _resume(run, model.base_fingerprint, audit, recorder)
        federation_run = resumed.federation_run if resumed else context.run_id
        _run_start(audit, federation_run, context.run_id, run, keys, policies, resumed)
        strategy = RegionalFedAvg(
            run,
            base_fingerprint=model.base_fingerprint,
            recorder=recorder,
            keys=keys,
            policies=policies,
            audit=audit,
            run_id=context.run_id,
            federation_run=federation_run,
            checkpoints=out_dir / "checkpoint",
        )
        strategy.start(
            grid,
            protocol.pack_arrays(resumed.adapter if resumed else model.adapter_state()),
            num_rounds=run.num_server_rounds,
            timeout=run.round_timeout,
            first_round=resumed.round + 1 if resumed else 1,
        )
        final = model_digest(strategy.global_adapter).hex()
        # Nothing published in any round: the global adapter is the initial one, and
        # saving it would present an untrained model as this run's result.
        status = COMPLETED if published_rounds(recorder.data) else NO_AGGREGATE
        adapter = None
        if status == COMPLETED:
            model.load_adapter_state(strategy.global_adapter)
            adapter = str(model.save_adapter(out_dir / ADAPTER_DIR))
        audit.append("run_end", run_id=federation_run, status=status, model_digest=final)
        audit.checkpoint(run_id=federation_run)
        strategy.witness_run_end(grid, run.round_timeout)
    except FedciuicError as err:
        recorder.finish(FAILED, error=str(err))
        log(ERROR, "fedciuic: %s", err)
        _run_failed(audit, context.run_id, err)
        raise SystemExit(1) from None
    except BaseException as err:
        # Not a fedciuic error: a signal's SystemExit, or a bug. Say so in metrics.json.
        if isinstance(err, KeyboardInterrupt | SystemExit):
            _stopped(recorder, f"stopped ({type(err).__name__}) before it ended")
        else:
            recorder.finish_unless_finished(FAILED, error=f"{type(err).__name__}: {err}")
        raise
    if status == NO_AGGREGATE:
        # The launchers (`fedciuic simulate`, run.sh) read this status and exit 3.
        recorder.finish(NO_AGGREGATE, adapter=None, reasons=no_aggregate_reasons(recorder.data))
        for line in summarize(recorder.data).splitlines():
            log(WARNING, "%s", line)
        return
    recorder.finish(COMPLETED, adapter=adapter)
    for line in summarize(recorder.data).splitlines():
        log(INFO, "%s", line)


def _policies(
    run: RunConfig, keys: AggregatorKeys | None, recorder: RunRecorder
) -> AggregatorPolicies | None:
    """Every region's policy, as the aggregator holds them; None only for a lab baseline."""
    if not run.enforce_policies:
        log(WARNING, "fedciuic: policies are OFF (enforce-policies = false): a lab baseline only")
        recorder.data["run"]["policies"] = None
        return None
    if keys is not None and keys.keypair.bundle.jurisdiction != run.aggregator_jurisdiction:
        raise PolicyError(
            f"run config:aggregator-jurisdiction: {run.aggregator_jurisdiction}, but the "
            f"aggregator's key says {keys.keypair.bundle.jurisdiction}; regions judge where the "
            "aggregator sits by its key: make them agree"
        )
    policies = AggregatorPolicies.load(run)
    for problem in policies.policies.problems:
        log(
            WARNING,
            "fedciuic: unreadable policy, its region's updates will be rejected: %s",
            problem,
        )
    recorder.data["run"]["policies"] = {
        j: {"file": str(p.path), "hash": p.hash}
        for j, p in sorted(policies.policies.by_jurisdiction.items())
    }
    return policies


def _audit_log(run: RunConfig) -> AuditLog:
    """The aggregator's audit log; paths are redacted unless the policy of the
    aggregator's own jurisdiction (when held) says otherwise."""
    redact = [(str(run.output_path), "<output-dir>")]
    redact += [
        (d, f"<{name}>")
        for name, d in (("keys-dir", run.keys_dir), ("policies-dir", run.policies_dir))
        if d
    ]
    return AuditLog(run.audit_path / AGGREGATOR_LOG, "aggregator", None, redact=redact)


def _resume(
    run: RunConfig, base_fingerprint: str, audit: AuditLog, recorder: RunRecorder
) -> Checkpoint | None:
    """The checkpoint to resume from (resume-from), checked against this model and
    against the audit log, which must still hold what the checkpoint saw."""
    if not run.resume_from:
        return None
    checkpoint = load_checkpoint(Path(run.resume_from).expanduser())
    if checkpoint.base_fingerprint != base_fingerprint:
        raise CheckpointError(
            f"run config:resume-from: {run.resume_from} was trained on another base model "
            f"({checkpoint.base_fingerprint[:12]}, this one is {base_fingerprint[:12]}); use "
            "the same model-preset and seed, or the same model-path"
        )
    if checkpoint.round >= run.num_server_rounds:
        raise CheckpointError(
            f"run config:resume-from: {run.resume_from} has completed round "
            f"{checkpoint.round} of {run.num_server_rounds}; nothing is left to resume"
        )
    audit.check_continues(checkpoint.audit_seq, checkpoint.audit_head)
    recorder.data["rounds"] = checkpoint.rounds
    recorder.data["run"]["resumed_from"] = {
        "federation_run": checkpoint.federation_run,
        "round": checkpoint.round,
        "checkpoint": run.resume_from,
    }
    log(
        INFO,
        "fedciuic: resuming run %d after round %d (%s)",
        checkpoint.federation_run,
        checkpoint.round,
        run.resume_from,
    )
    return checkpoint


def _run_start(
    audit: AuditLog,
    run_id: int,
    flower_run: int,
    run: RunConfig,
    keys: AggregatorKeys | None,
    policies: AggregatorPolicies | None,
    resumed: Checkpoint | None,
) -> None:
    own = policies.policies.get(run.aggregator_jurisdiction) if policies else None
    if own is not None and not own.policy.audit.redact_paths:
        audit.redact = ()
    audit.append(
        "run_start",
        run_id=run_id,
        config_hash=config_hash(run.model_dump(by_alias=True, mode="json")),
        code_version=code_version(),
        regions=list(run.regions),
        aggregator_jurisdiction=run.aggregator_jurisdiction,
        relay_jurisdiction=run.relay,
        key_id=keys.keypair.bundle.key_id.hex() if keys else None,
        region_key_ids={b.party: kid.hex() for kid, b in keys.regions.items()} if keys else {},
        policy_hashes=(
            {j: p.hash for j, p in sorted(policies.policies.by_jurisdiction.items())}
            if policies
            else None
        ),
        flower_run=flower_run,
        resumed_after_round=resumed.round if resumed else None,
    )


def _stopped(recorder: RunRecorder, reason: str) -> None:
    """Mark the run interrupted if it has not ended (metrics.json only: the audit log
    belongs to the thread that was interrupted mid-way, and must not be written here)."""
    for _ in range(3):  # the run's thread may be changing the record right now
        try:
            if recorder.finish_unless_finished(INTERRUPTED, error=reason):
                log(WARNING, "fedciuic: run %s", reason)
            return
        except (RuntimeError, OSError) as err:
            problem = err
    log(ERROR, "fedciuic: cannot mark the run interrupted: %s", problem)


def _run_failed(audit: AuditLog | None, run_id: int, err: FedciuicError) -> None:
    if audit is None:
        return
    try:
        audit.append("run_end", run_id=run_id, status="failed", error=str(err))
        audit.checkpoint(run_id=run_id)
    except FedciuicError as audit_err:  # the run has failed already; say so, go on
        log(ERROR, "fedciuic: cannot write the audit log: %s", audit_err)
