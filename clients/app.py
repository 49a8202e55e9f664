"""ClientApp: one region. Reads its Context, calls fedciuic, packs the reply.

Expected problems (bad data path, unknown region, mismatched base model, missing
keys, a global adapter the aggregator did not sign, a run its jurisdiction's policy
refuses) become a decline with every reason; the aggregator records it and goes
on with the others. With sealing on, an update leaves only inside an envelope
whose header names the policy the region applied.
"""

from __future__ import annotations

from functools import lru_cache
from logging import WARNING

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.supercore import log

from fedciuic.compliance import enforce_region_policy
from fedciuic.config import NodeConfig, RunConfig
from fedciuic.errors import FedciuicError
from fedciuic.flower import protocol
from fedciuic.policy import LoadedPolicy
from fedciuic.region import Region, open_region
from fedciuic.sealing import RegionKeys, region_keys, update_payload

app = ClientApp()


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


def _name(context: Context) -> str:
    """The region's name for a decline, even when its config is broken."""
    node = context.node_config
    try:
        return _configs(context)[1].region
    except FedciuicError:
        return str(node.get("region") or f"partition-{node.get('partition-id', '?')}")


def _decline(msg: Message, context: Context, err: FedciuicError) -> Message:
    log(WARNING, "fedciuic: region declines: %s", err)
    return Message(protocol.decline_reply(_name(context), str(err)), reply_to=msg)


def _prepare(
    msg: Message, context: Context, *, training: bool
) -> tuple[Region, protocol.Instruction, RegionKeys | None, LoadedPolicy | None]:
    """Open the region and check the instruction and the region's policy before
    anything is computed."""
    run, node = _configs(context)
    task = protocol.read_instruction(msg)
    keys = None
    if run.seal:
        keys = _keys(run, node)
        keys.check_global(
            task.signature, task.signer, context.run_id, task.server_round, task.adapter
        )
    region = open_region(run, node)
    policy = enforce_region_policy(
        run,
        node,
        simulated=NodeConfig.is_simulated(context.node_config),
        # With sealing, where the aggregator sits is what its bundle (our copy) says.
        aggregator_jurisdiction=keys.aggregator.jurisdiction
        if keys
        else run.aggregator_jurisdiction,
        projected_epsilon=region.projected_epsilon() if training else None,
    )
    return region, task, keys, policy


@app.train()
def train(msg: Message, context: Context) -> Message:
    try:
        region, task, keys, policy = _prepare(msg, context, training=True)
        outcome = region.train_round(
            task.adapter,
            server_round=task.server_round,
            base_fingerprint=task.base_fingerprint,
            run_id=context.run_id,
        )
        if keys is None:
            return Message(protocol.train_reply(outcome, policy), reply_to=msg)
        payload = update_payload(
            protocol.update_arrays(outcome.update),
            protocol.train_metrics(outcome),
            protocol.train_info(outcome, policy),
        )
        envelope = keys.seal_update(
            payload,
            run_id=context.run_id,
            server_round=task.server_round,
            policy_hash=policy.hash if policy else "",
        )
    except FedciuicError as err:
        return _decline(msg, context, err)
    key_id = keys.keypair.bundle.key_id.hex()
    return Message(protocol.sealed_reply(region.name, envelope, key_id), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    try:
        region, task, _, _ = _prepare(msg, context, training=False)
        stats = region.evaluate(task.adapter, base_fingerprint=task.base_fingerprint)
    except FedciuicError as err:
        return _decline(msg, context, err)
    return Message(protocol.evaluate_reply(region.name, stats), reply_to=msg)
