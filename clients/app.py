"""ClientApp: one region. Reads its Context, calls fedciuic, packs the reply.

Expected problems (bad data path, unknown region, mismatched base model, missing
keys, a global adapter the aggregator did not sign, a run its jurisdiction's policy
refuses) become a decline with every reason; the aggregator records it and goes
on with the others. With sealing on, an update leaves only inside an envelope
whose header names the policy the region applied. Everything the region decides
and sends is written to its audit log (in its state-path) before the reply
leaves, and each reply ends with a signed checkpoint.
"""

from __future__ import annotations

from functools import lru_cache
from logging import WARNING
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore import log

from fedciuic.audit.log import REGION_LOG, AuditLog, code_version, config_hash, digest
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.crypto.sealing import (
    AGGREGATOR,
    MalformedPayload,
    RegionKeys,
    read_update_payload,
    region_keys,
    update_payload,
)
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.policy.binding import PolicyRefusal, enforce_region_policy
from fedciuic.policy.rules import LoadedPolicy
from fedciuic.rounds.region import AlreadyReleased, SentUpdates, TrainOutcome, open_region

app = ClientApp()
_LOGS: dict[Path, AuditLog] = {}
_JOINED: set[tuple[Path, int]] = set()


def _configs(context: Context) -> tuple[RunConfig, NodeConfig]:
    run = RunConfig.from_user_config(context.run_config, source="run config")
    return run, NodeConfig.resolve(context.node_config, run)


@lru_cache(maxsize=4)
def _keys(run: RunConfig, node: NodeConfig) -> RegionKeys:
    return region_keys(
        node.region,
        key_file=node.key_file,
        aggregator_bundle=node.aggregator_bundle,
        keys_dir=run.keys_dir,
        suite=run.seal_suite,
    )


def _audit(node: NodeConfig) -> AuditLog | None:
    """The region's audit log (one per state-path, kept open by this process); None
    when its default place, inside a data-path that does not exist, cannot be made
    without creating that data-path. Paths are redacted unless the policy says not."""
    if not node.state_path and not Path(node.data_path).is_dir():
        return None
    path = node.state_dir / REGION_LOG
    if path not in _LOGS:
        redact = [(str(node.state_dir), "<state-path>"), (node.data_path, "<data-path>")]
        _LOGS[path] = AuditLog(path, node.region, None, redact=redact)
    return _LOGS[path]


def _name(context: Context) -> str:
    """The region's name for a decline, even when its config is broken."""
    node = context.node_config
    try:
        return _configs(context)[1].region
    except FedciuicError:
        return str(node.get("region") or f"partition-{node.get('partition-id', '?')}")


class _Round:
    """One instruction handled by the region, from checks to reply, with its audit trail."""

    def __init__(self, msg: Message, context: Context) -> None:
        self.msg, self.context = msg, context
        # Flower's run id binds envelopes and signatures; the federation's run id (the
        # same, unless this run resumes another) keys the ledger, the audit log and
        # the updates kept for resending.
        self.flower_run = self.run_id = context.run_id
        self.audit: AuditLog | None = None
        self.keys: RegionKeys | None = None
        self.server_round: int | None = None

    def note(self, event: str, **details: object) -> None:
        if self.audit is not None:
            self.audit.append(event, run_id=self.run_id, server_round=self.server_round, **details)

    def handle(self, *, training: bool) -> Message:
        """The reply, once everything about it is in the audit log and signed; a log
        that cannot be written turns any reply into a decline (fail closed)."""
        try:
            content = self._handle(training)
            if self.audit is not None:
                self.audit.checkpoint(run_id=self.run_id, server_round=self.server_round)
        except FedciuicError as err:
            content = self._decline(err)
        try:
            content = self._vouch(content)
        except FedciuicError as err:  # cannot read our own log or sign: decline, unsigned
            content = self._decline(err)
        return Message(content, reply_to=self.msg)

    def witness_run_end(self) -> Message:
        """Record the head of the aggregator's log after its ``run_end`` (checked against
        its signature), sign our log, and answer with our own head, signed."""
        try:
            run, node = _configs(self.context)
            notice = protocol.read_run_end(self.msg)
            self.run_id = notice.federation_run or self.flower_run
            self.audit = _audit(node)
            if run.seal:
                self.keys = _keys(run, node)
                self.keys.check_run_end(
                    notice.signature, notice.signer, self.flower_run, notice.witness
                )
                if self.audit is not None:
                    self.audit.keypair = self.keys.keypair
            if self.audit is not None:
                self.audit.witness(AGGREGATOR, *notice.witness, run_id=self.run_id)
                self.audit.checkpoint(run_id=self.run_id)
            content = self._vouch(protocol.witnessed_reply(node.region))
        except FedciuicError as err:
            log(WARNING, "fedciuic: region cannot witness the run's end: %s", err)
            content = protocol.decline_reply(_name(self.context), str(err))
        return Message(content, reply_to=self.msg)

    def _vouch(self, content: RecordDict) -> RecordDict:
        """Carry the head of this region's latest signed audit checkpoint (the aggregator
        records it: truncating this log later shows) and, with sealing, sign the reply,
        so that it is recorded under this region and no other."""
        head = self.audit.last_checkpoint() if self.audit is not None else None
        if head is not None:
            content = protocol.add_witness(content, *head)
        if self.keys is None:
            return content
        return protocol.sign_reply(
            content, self.keys.keypair, run_id=self.flower_run, server_round=self.server_round or 0
        )

    def _decline(self, err: FedciuicError) -> RecordDict:
        log(WARNING, "fedciuic: region declines: %s", err)
        try:
            if isinstance(err, PolicyRefusal):
                self.note("policy_decision", **err.decision.to_record())
            self.note("declined", reason=str(err))
            if self.audit is not None:
                self.audit.checkpoint(run_id=self.run_id, server_round=self.server_round)
        except FedciuicError as audit_err:
            log(WARNING, "fedciuic: cannot write the audit log: %s", audit_err)
        return protocol.decline_reply(_name(self.context), str(err))

    def _handle(self, training: bool) -> RecordDict:
        run, node = _configs(self.context)
        task = protocol.read_instruction(self.msg)
        self.server_round = task.server_round
        self.run_id = task.federation_run or self.flower_run
        self.audit = _audit(node)
        keys = None
        if run.seal:
            keys = _keys(run, node)
            if self.audit is not None:
                self.audit.keypair = keys.keypair
            keys.check_global(
                task.signature,
                task.signer,
                self.flower_run,
                task.server_round,
                task.adapter,
                task.witness,
            )
            self.keys = keys
        if task.witness is not None and self.audit is not None:
            self.audit.witness(
                AGGREGATOR,
                *task.witness,
                run_id=self.run_id,
                server_round=self.server_round,
            )
        region = open_region(run, node)
        sent = SentUpdates(node.state_dir)
        kept = sent.load(self.run_id, task.server_round) if training else None
        # With sealing, where the aggregator sits is what its bundle (our copy) says.
        destination = keys.aggregator.jurisdiction if keys else run.aggregator_jurisdiction
        checked = enforce_region_policy(
            run,
            node,
            simulated=NodeConfig.is_simulated(self.context.node_config),
            aggregator_jurisdiction=destination,
            own_jurisdiction=keys.keypair.bundle.jurisdiction if keys else None,
            projected_epsilon=region.projected_epsilon() if training and not kept else None,
        )
        policy = checked[0] if checked else None
        if self.audit is not None and policy is not None and not policy.policy.audit.redact_paths:
            self.audit.redact = ()
        self._join(run, keys, policy)
        if checked is not None:
            self.note("policy_decision", **checked[1].to_record())
        if not training:
            stats = region.evaluate(task.adapter, base_fingerprint=task.base_fingerprint)
            self.note("evaluated", examples=stats.num_examples, loss=stats.loss)
            return protocol.evaluate_reply(region.name, stats)
        if kept is not None:
            # This round was released before the aggregator restarted: the same update
            # again, no second release and no second charge to the ledger.
            self.note("update_resent", federation_run=self.run_id, flower_run=self.flower_run)
            return self._send(region.name, kept, keys, policy, destination)
        if region.released(self.run_id, task.server_round):
            raise AlreadyReleased(
                f"region {region.name}: round {task.server_round} of run {self.run_id} was "
                "already released (the privacy ledger records it) and its update was not "
                "kept; nothing is released twice, so this region sits out the round"
            )
        outcome = region.train_round(
            task.adapter,
            server_round=task.server_round,
            base_fingerprint=task.base_fingerprint,
            run_id=self.run_id,
            max_run_epsilon=policy.policy.privacy.max_epsilon_per_run if policy else None,
        )
        self._note_trained(outcome)
        payload = update_payload(
            protocol.update_arrays(outcome.update),
            protocol.train_metrics(outcome),
            protocol.train_info(outcome, policy),
        )
        sent.save(self.run_id, task.server_round, payload)
        return self._send(region.name, payload, keys, policy, destination)

    def _join(self, run: RunConfig, keys: RegionKeys | None, policy: LoadedPolicy | None) -> None:
        if self.audit is None or (self.audit.path, self.run_id) in _JOINED:
            return
        _JOINED.add((self.audit.path, self.run_id))
        self.note(
            "run_joined",
            config_hash=config_hash(run.model_dump(by_alias=True, mode="json")),
            code_version=code_version(),
            key_id=keys.keypair.bundle.key_id.hex() if keys else None,
            aggregator_key_id=keys.aggregator.key_id.hex() if keys else None,
            policy_hash=policy.hash if policy else None,
            jurisdiction=policy.policy.jurisdiction if policy else None,
        )

    def _note_trained(self, outcome: TrainOutcome) -> None:
        p = outcome.privacy
        self.note(
            "trained",
            examples=outcome.stats.num_examples,
            steps=outcome.stats.steps,
            data_fingerprint=outcome.data_fingerprint,
            epsilon=p.epsilon if p else None,
            epsilon_budget=p.epsilon_budget if p else None,
            delta=p.delta if p else None,
            noise_multiplier=p.noise_multiplier if p else None,
            run_epsilon=p.run_epsilon if p else None,
            ledger=p.ledger if p else None,  # witnesses the ledger's head (docs/privacy.md)
        )

    def _send(
        self,
        region: str,
        payload: bytes,
        keys: RegionKeys | None,
        policy: LoadedPolicy | None,
        destination: str,
    ) -> RecordDict:
        """Seal the update (or, with sealing off, send it clear); log it before it leaves."""
        policy_hash = policy.hash if policy else ""
        if keys is None:
            arrays, metrics, info = read_update_payload(payload)
            update = arrays[protocol.UPDATE].tobytes()
            self.note(
                "update_sent_clear",
                region=region,
                digest=digest(update),
                bytes=len(update),
                suite="none",
                destination_jurisdiction=destination,
                policy_hash=policy_hash,
            )
            if not isinstance(metrics, dict) or not isinstance(info, dict):
                raise MalformedPayload(f"region {region}: the kept update is not one")
            return protocol.clear_reply(arrays, metrics, info)
        envelope = keys.seal_update(
            payload,
            run_id=self.flower_run,
            server_round=self.server_round or 0,
            policy_hash=policy_hash,
        )
        self.note(
            "update_sealed",
            region=region,
            digest=digest(envelope),
            bytes=len(envelope),
            suite=keys.suite,
            destination=keys.aggregator.party,
            destination_jurisdiction=destination,
            aggregator_key_id=keys.aggregator.key_id.hex(),
            policy_hash=policy_hash,
        )
        key_id = keys.keypair.bundle.key_id.hex()
        return protocol.sealed_reply(region, envelope, key_id)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The aggregator's run-end notice: record its final audit head, answer with ours."""
    return _Round(msg, context).witness_run_end()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _Round(msg, context).handle(training=True)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _Round(msg, context).handle(training=False)
