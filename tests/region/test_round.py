"""The region's round driven with plain dataclasses: no Flower Message, no task identity."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic.audit.log import AuditError, AuditLog, load_records, verify
from fedciuic.cluster import training as training_module
from fedciuic.config import ModelSpec, NodeConfig, RunConfig
from fedciuic.crypto.keys import Keypair, load_bundle
from fedciuic.crypto.parties import (
    NONCE_BYTES,
    AggregatorKeys,
    TaskKind,
    aggregator_keys,
    generate_federation_keys,
    sign_global,
)
from fedciuic.deid.entities import DIRECT
from fedciuic.errors import FedciuicError
from fedciuic.model.adapter import AdapterModel
from fedciuic.policy.rules import load_policy
from fedciuic.privacy import dpsgd
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.region import round as round_module
from fedciuic.region import trainer as trainer_module
from fedciuic.region.round import (
    Declined,
    Evaluated,
    RegionReply,
    RunEndWitnessed,
    handle_instruction,
    read_configs,
    region_name,
    region_records,
    unreadable,
    witness_run_end,
)
from fedciuic.region.trainer import Kept, SentUpdates
from fedciuic.releases import WITHHELD_REASON
from fedciuic.stages.sealing import Clear, Sealed
from fedciuic.wire import PRIVACY_UNIT, Instruction, RunEndNotice
from tests.conftest import (
    EXACT_RELEASES,
    ROOT,
    app_config,
    lab_policies,
    signed_run_end,
    unit_config,
    write_policy,
)

HEAD = "cd" * 32
FLOWER_RUN = 7


@pytest.fixture(scope="module")
def model() -> AdapterModel:
    return AdapterModel(ModelSpec())


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lab copies of the shipped policies, one per region."""
    return lab_policies(tmp_path_factory.mktemp("policies"))


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_federation_keys(tmp_path_factory.mktemp("keys"), ("eu", "cn", "us"))


@pytest.fixture
def run(model: AdapterModel, policies: Path, demo_root: Path):
    """Run one round as the region would: unsealed unless the test seals, under the lab
    copy of its jurisdiction's policy unless the test names another, a deployed region
    with the demo's dictionary of its names (the policies require names). The instruction
    carries the run config (and the kind of task) that the aggregator signs; ``asked``:
    what the message asks for, when not ``kind``; ``given``: changes to the run config
    the round is handed, when not the one in the instruction."""

    def call(
        node_config: dict[str, Any],
        run_overrides: dict[str, Any] | None = None,
        *,
        kind: TaskKind = TaskKind.TRAIN,
        asked: TaskKind | None = None,
        given: dict[str, Any] | None = None,
        signer: Keypair | None = None,
        witness: tuple[int, str] | None = None,
        sent_witness: tuple[int, str] | None = None,
        checkpoint: str = "",
        sent_checkpoint: str | None = None,
        recipient: str | None = None,
    ) -> RegionReply:
        settings = {**unit_config(), "local-steps": 2, "seal": False, **(run_overrides or {})}
        if "region" in node_config:
            region = node_config["region"]
            node_config = {
                "policy": str(policies / f"{region}.yaml"),
                "deid-dictionary": str(demo_root / "deid-dictionaries" / f"{region}.txt"),
                **node_config,
            }
        run_cfg = RunConfig.from_user_config(settings, source="run config")
        adapter = model.adapter_state()
        task = Instruction(
            adapter=adapter,
            server_round=1,
            base_fingerprint=model.base_fingerprint,
            kind=kind,
            run_config=run_cfg.canonical_json(),
            nonce=secrets.token_bytes(NONCE_BYTES),
            witness=sent_witness or witness,
            checkpoint=checkpoint,
            recipient=recipient or region_name(settings, node_config),
        )
        if signer is not None:
            signature = sign_global(signer, FLOWER_RUN, 1, adapter, task.terms, witness)
            task = replace(task, signature=signature, signer=signer.bundle.key_id.hex())
        if sent_checkpoint is not None:
            task = replace(task, checkpoint=sent_checkpoint)
        applied, node = read_configs(task, node_config)
        assert applied == run_cfg  # the run config the instruction carries
        if given is not None:
            applied = RunConfig.from_user_config({**settings, **given}, source="run config")
        return handle_instruction(
            applied,
            node,
            task,
            asked=kind if asked is None else asked,
            flower_run=FLOWER_RUN,
            simulated=NodeConfig.is_simulated(node_config),
        )

    return call


def sealed_run(keys_dir: Path) -> tuple[dict[str, Any], AggregatorKeys]:
    return {"seal": True, "keys-dir": str(keys_dir)}, aggregator_keys(str(keys_dir), 2**28)


def cn_node(demo_root: Path, state: Path, policy: Path | None = None) -> dict[str, str]:
    node = {"region": "cn", "data-path": str(demo_root / "cn"), "state-path": str(state)}
    if policy is not None:
        node["policy"] = str(policy)
    return node


def declined(reply: RegionReply) -> Declined:
    assert isinstance(reply.outcome, Declined), reply.outcome
    return reply.outcome


# -- training, sealing and what is logged before it leaves ---------------------------------


def test_a_sealed_round_trains_seals_logs_and_is_vouched_for(
    run, demo_root, tmp_path, keys_dir, policies
):
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(cn_node(demo_root, tmp_path), run_overrides, signer=aggregator.keypair)
    sealed = reply.outcome
    assert isinstance(sealed, Sealed) and sealed.region == "cn"
    opened = aggregator.open_update(sealed.envelope, run_id=FLOWER_RUN, server_round=1)
    info, metrics = opened.info, opened.metrics  # untrusted until parsed: plain dicts here
    assert isinstance(info, dict) and isinstance(metrics, dict)
    assert opened.sender.party == "cn" and info["region"] == "cn"
    assert set(opened.arrays) == {"update"} and metrics["num-examples"] > 0
    # The header names the policy the region applied; the payload says so too.
    cn_policy = load_policy(policies / "cn.yaml")
    assert opened.policy_hash == cn_policy.hash == info["policy-hash"]
    assert info["jurisdiction"] == "CN" and opened.suite == "xwing-aes256gcm"
    assert sealed.key_id == load_bundle(keys_dir / "cn.pub.json").key_id.hex()
    # Vouched: the region's keypair signs the reply for this run and round ...
    assert reply.keypair is not None and reply.keypair.bundle.party == "cn"
    assert (reply.flower_run, reply.server_round) == (FLOWER_RUN, 1)
    # ... which carries the head of the checkpoint that closes the round's audit trail.
    log = tmp_path / "audit.jsonl"
    assert verify(log, load_bundle(keys_dir / "cn.pub.json")).ok
    records = load_records(log)
    events = [r["event"] for r in records]
    assert events[-5:] == [
        "policy_decision",
        "data_deidentified",
        "trained",
        "update_sealed",
        "checkpoint",
    ]
    # What the texts were scrubbed of before training: the pipeline and counts, declared
    # to the aggregator under the seal, recorded in the region's own log (the demo's
    # synthetic identifiers; no value).
    # (the demo's dictionary, data-root/deid-dictionaries/cn.txt, meets the policy's names)
    declared = (*DIRECT, "DICTIONARY", "CONTEXT_NAME")
    assert info["deid-entities"] == ",".join(declared)
    scrubbed = records[-4]["details"]
    assert scrubbed["identity"]["entities"] == list(declared)
    assert scrubbed["counts"]["EMAIL_ADDRESS"] > 0 and scrubbed["records"] > 0
    assert "@example.org" not in json.dumps(records)
    assert reply.witness == (records[-1]["details"]["count"], records[-1]["details"]["head"])
    details = records[-2]["details"]
    assert details["digest"] == hashlib.sha256(sealed.envelope).hexdigest()
    assert details["bytes"] == len(sealed.envelope)
    assert details["destination_jurisdiction"] == "EU"
    assert details["policy_hash"] == opened.policy_hash
    assert records[-3]["details"]["epsilon"] == pytest.approx(metrics["epsilon"])


def test_an_unsealed_round_sends_its_update_clear_and_evaluation_its_stats(
    run, demo_root, tmp_path, policies
):
    reply = run(cn_node(demo_root, tmp_path))
    clear = reply.outcome
    assert isinstance(clear, Clear) and reply.keypair is None
    assert set(clear.arrays) == {"update"} and clear.metrics["num-examples"] > 0
    assert clear.info["policy-hash"] == load_policy(policies / "cn.yaml").hash
    assert "update_sent_clear" in [r["event"] for r in load_records(tmp_path / "audit.jsonl")]
    exact = run(cn_node(demo_root, tmp_path), EXACT_RELEASES, kind=TaskKind.EVALUATE)
    evaluated = exact.outcome
    assert isinstance(evaluated, Evaluated) and evaluated.region == "cn"
    assert evaluated.stats.num_examples > 0
    # Under DP, a timed local step (what the aggregator's training wait sizes on), in a
    # run that releases figures of the data anyway (an exact evaluation).
    assert evaluated.stats.step_seconds is not None and evaluated.stats.step_seconds > 0
    packed = region_records(RegionReply(evaluated))
    assert packed.metrics["step-seconds"] == evaluated.stats.step_seconds


def test_the_freed_heap_is_handed_back_at_the_runs_end_not_between_rounds(
    run, demo_root, tmp_path, keys_dir, policies, monkeypatch
):
    """Pages handed back are faulted in again by the next message: a round's training
    and evaluation keep the heap (declined or not), the run's end hands it back (also
    when its notice is refused)."""
    calls: list[int] = []
    monkeypatch.setattr(round_module, "release_freed_memory", lambda: calls.append(1))
    run(cn_node(demo_root, tmp_path))
    run({"region": "cn", "data-path": str(tmp_path / "nowhere")})  # declined
    run(cn_node(demo_root, tmp_path), EXACT_RELEASES, kind=TaskKind.EVALUATE)
    run({"region": "cn", "data-path": str(tmp_path / "nowhere")}, kind=TaskKind.EVALUATE)
    assert calls == []
    node_config = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path / "eu"),
        "policy": str(policies / "eu.yaml"),
    }
    settings = {**unit_config(), "seal": True, "keys-dir": str(keys_dir)}
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    notice = signed_run_end(aggregator.keypair, FLOWER_RUN, settings, (9, HEAD), recipient="eu")
    run_cfg, node = read_configs(notice, node_config)
    assert witness_run_end(run_cfg, node, notice, flower_run=FLOWER_RUN).outcome == (
        RunEndWitnessed("eu")
    )
    assert calls == [1]
    forged = replace(notice, witness=(10, HEAD))
    declined(witness_run_end(run_cfg, node, forged, flower_run=FLOWER_RUN))
    assert calls == [1, 1]


def test_a_released_round_is_resent_as_it_was_never_trained_twice(run, demo_root, tmp_path):
    """A restarted aggregator asks again: the same update, no second ledger charge."""
    node = cn_node(demo_root, tmp_path)
    first = run(node).outcome
    ledger = (tmp_path / "privacy-ledger.jsonl").read_text()
    again = run(node).outcome
    assert isinstance(first, Clear) and isinstance(again, Clear)
    np.testing.assert_array_equal(again.arrays["update"], first.arrays["update"])
    assert again.metrics == first.metrics
    assert (tmp_path / "privacy-ledger.jsonl").read_text() == ledger
    assert "update_resent" in [r["event"] for r in load_records(tmp_path / "audit.jsonl")]
    # Without the kept update, the region sits out rather than release the round again.
    for kept in (tmp_path / "sent").iterdir():
        kept.unlink()
    assert "was already released" in declined(run(node)).reason
    assert (tmp_path / "privacy-ledger.jsonl").read_text() == ledger


def test_a_damaged_kept_update_declines_naming_its_file_and_charges_nothing(
    run, demo_root, tmp_path
):
    node = cn_node(demo_root, tmp_path)
    assert isinstance(run(node).outcome, Clear)
    ledger = (tmp_path / "privacy-ledger.jsonl").read_text()
    (kept,) = (tmp_path / "sent").iterdir()
    whole = kept.read_bytes()
    store = SentUpdates(tmp_path)
    store.save(FLOWER_RUN, 1, Kept(b"update", {"run_id": 1}))  # a field a record never has
    foreign = kept.read_bytes()
    # Cut inside its record; inside the update; a record of other fields.
    for damaged in (whole[:20], whole[:-1], foreign):
        kept.write_bytes(damaged)
        reason = declined(run(node)).reason
        assert kept.name in reason and "unreadable kept update" in reason
        assert (tmp_path / "privacy-ledger.jsonl").read_text() == ledger


def test_an_audit_log_that_cannot_be_written_turns_the_reply_into_a_decline(
    run, demo_root, tmp_path, monkeypatch
):
    def refuse(self, **kwargs):
        raise AuditError("disk full")

    monkeypatch.setattr(AuditLog, "checkpoint", refuse)
    reply = run(cn_node(demo_root, tmp_path))
    assert declined(reply).reason == "disk full"


# -- declines, with every reason ---------------------------------------------------------------


def test_corrupted_ledger_declines_naming_the_file(run, demo_root, tmp_path):
    (tmp_path / "privacy-ledger.jsonl").write_text('{"kind": "header"}\n')
    reason = declined(run(cn_node(demo_root, tmp_path))).reason
    assert "privacy-ledger.jsonl:1: corrupted ledger record" in reason


def test_missing_data_path_declines_naming_the_region_and_path(run, tmp_path):
    node = {"region": "eu", "data-path": str(tmp_path / "missing")}
    reply = run(node, kind=TaskKind.EVALUATE)
    assert declined(reply).region == "eu"
    assert f"data-path {tmp_path / 'missing'} does not exist" in declined(reply).reason
    assert reply.witness is None  # no log to vouch with: its place does not exist


def test_empty_dataset_declines(run, tmp_path):
    (tmp_path / "eu").mkdir()
    reply = run({"region": "eu", "data-path": str(tmp_path / "eu")})
    assert "holds no data files" in declined(reply).reason


def test_mismatched_base_model_declines(run, demo_root, tmp_path):
    node = {"region": "eu", "data-path": str(demo_root / "eu"), "state-path": str(tmp_path)}
    assert "base model fingerprint" in declined(run(node, {"seed": 5})).reason


def test_a_config_that_cannot_be_read_declines_under_the_name_it_gives(model, demo_root):
    run_config = {**unit_config(), "seal": False}
    task = Instruction(
        adapter=model.adapter_state(),
        server_round=1,
        base_fingerprint=model.base_fingerprint,
        run_config=RunConfig.from_user_config(run_config, source="test").canonical_json(),
    )
    node = {"region": "sg", "data-path": str(demo_root)}
    with pytest.raises(FedciuicError, match="'sg' is not a region of this run") as caught:
        read_configs(task, node)
    reply = unreadable(run_config, node, caught.value)
    assert declined(reply).region == "sg" and reply.keypair is None and reply.witness is None
    assert "node config:region: 'sg' is not a region of this run" in declined(reply).reason


def test_unsigned_global_adapter_is_refused(run, demo_root, tmp_path, keys_dir):
    run_overrides, _ = sealed_run(keys_dir)
    impostor = Keypair.generate("aggregator", "EU")
    reply = run(cn_node(demo_root, tmp_path), run_overrides, signer=impostor)
    assert "is not signed by the aggregator key" in declined(reply).reason
    assert not (tmp_path / "privacy-ledger.jsonl").exists()  # nothing trained


def test_an_audit_head_the_aggregator_did_not_sign_is_refused(run, demo_root, tmp_path, keys_dir):
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(
        cn_node(demo_root, tmp_path),
        run_overrides,
        kind=TaskKind.EVALUATE,
        signer=aggregator.keypair,
        witness=(5, HEAD),
        sent_witness=(4, HEAD),
    )
    assert "is not signed by the aggregator key" in declined(reply).reason
    records = load_records(tmp_path / "audit.jsonl")
    assert not [r for r in records if r["event"] == "witness"]


def test_a_resumed_run_puts_the_checkpoint_it_continued_from_on_the_regions_record(
    run, demo_root, tmp_path, keys_dir
):
    run_overrides, aggregator = sealed_run(keys_dir)
    node = cn_node(demo_root, tmp_path)
    identity = "c" * 64
    for checkpoint in ("", identity):  # the run, then the same run resumed
        reply = run(
            node,
            run_overrides,
            kind=TaskKind.EVALUATE,
            signer=aggregator.keypair,
            checkpoint=checkpoint,
        )
        assert not isinstance(reply.outcome, Declined), reply.outcome
    joined = [r for r in load_records(tmp_path / "audit.jsonl") if r["event"] == "run_joined"]
    assert [r["details"]["resumed_from_checkpoint"] for r in joined] == [None, identity]


def test_a_checkpoint_identity_the_aggregator_did_not_sign_is_refused(
    run, demo_root, tmp_path, keys_dir
):
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(
        cn_node(demo_root, tmp_path),
        run_overrides,
        kind=TaskKind.EVALUATE,
        signer=aggregator.keypair,
        checkpoint="c" * 64,
        sent_checkpoint="d" * 64,  # a relay claims the run resumed from another one
    )
    assert "is not signed by the aggregator key" in declined(reply).reason


def test_an_evaluation_handed_over_as_a_training_round_is_declined_and_trains_nothing(
    run, demo_root, tmp_path, keys_dir
):
    """The aggregator signs the kind of task: a relay cannot turn an evaluation into a
    training round (a release the aggregator never asked for)."""
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(
        cn_node(demo_root, tmp_path),
        run_overrides,
        kind=TaskKind.EVALUATE,
        asked=TaskKind.TRAIN,
        signer=aggregator.keypair,
    )
    reason = declined(reply).reason
    assert re.search(r"a train message carries an instruction to evaluate", reason), reason
    assert not (tmp_path / LEDGER_FILE).exists()  # nothing trained, nothing accounted
    assert not (tmp_path / "sent").exists()  # nothing kept to resend
    records = load_records(tmp_path / "audit.jsonl")
    events = [r["event"] for r in records]
    assert "trained" not in events and "evaluated" not in events
    assert records[-2]["event"] == "declined" and records[-1]["event"] == "checkpoint"
    assert reply.keypair is not None  # its signature checked out: the decline is signed


def test_a_run_config_other_than_the_signed_one_is_declined(run, demo_root, tmp_path, keys_dir):
    """The region applies the run config the aggregator signed into the instruction,
    never another one it is handed."""
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(
        cn_node(demo_root, tmp_path),
        run_overrides,
        given={"local-steps": 3},
        signer=aggregator.keypair,
    )
    reason = declined(reply).reason
    assert "the run config to apply is not the one the aggregator signed" in reason
    assert not (tmp_path / LEDGER_FILE).exists()  # nothing trained
    events = [r["event"] for r in load_records(tmp_path / "audit.jsonl")]
    assert "trained" not in events and "declined" in events


def test_missing_keys_decline_and_nothing_is_sent_unsealed(run, demo_root, tmp_path):
    reply = run(cn_node(demo_root, tmp_path), {"seal": True, "keys-dir": str(tmp_path / "none")})
    assert "cn.key.json: no private key here" in declined(reply).reason


def test_a_corrupted_key_file_declines_sends_nothing_and_is_audited(
    run, demo_root, tmp_path, keys_dir
):
    keys = tmp_path / "keys"
    shutil.copytree(keys_dir, keys)
    private = keys / "cn.key.json"
    data = json.loads(private.read_text())
    data["xwing_seed"] = base64.b64encode(b"\x01" * 32).decode()  # no longer its key id
    private.write_text(json.dumps(data))
    private.chmod(0o600)
    state = tmp_path / "state"
    run_overrides, aggregator = sealed_run(keys)
    reply = run(cn_node(demo_root, state), run_overrides, signer=aggregator.keypair)
    assert f"{private}:key_id: does not match the keys in the file" in declined(reply).reason
    logged = [r for r in load_records(state / "audit.jsonl") if r["event"] == "declined"]
    assert "key_id: does not match" in logged[-1]["details"]["reason"]
    assert not (state / "privacy-ledger.jsonl").exists()


def test_cn_declines_a_us_aggregator_with_every_reason_trains_nothing_and_logs_it(
    run, demo_root, tmp_path
):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    reply = run(node, {"aggregator-jurisdiction": "US", "relay-jurisdiction": "SG"})
    reason = declined(reply).reason
    assert "cn-pipl.yaml" in reason
    for rule in (
        "aggregator in US, CN's policy allows CN, EU (transfers.aggregator_jurisdictions)",
        "relay in SG, a third country for CN (transfers.relay_in_third_country)",
        "updates would leave unsealed (sealing.required)",
    ):
        assert rule in reason
    assert not (tmp_path / "privacy-ledger.jsonl").exists()  # nothing trained
    records = load_records(tmp_path / "audit.jsonl")
    decision = [r for r in records if r["event"] == "policy_decision"]
    assert decision[-1]["details"]["outcome"] == "decline"
    assert len(decision[-1]["details"]["reasons"]) == 3  # aggregator, relay, unsealed
    assert records[-1]["event"] == "checkpoint"


def test_policy_refusal_also_stops_evaluation(run, demo_root, tmp_path):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    reply = run(node, {"aggregator-jurisdiction": "US"}, kind=TaskKind.EVALUATE)
    assert "transfers.aggregator_jurisdictions" in declined(reply).reason


def test_a_round_past_the_policys_lifetime_epsilon_is_declined_before_training(
    run, demo_root, tmp_path
):
    policy = write_policy(
        tmp_path / "cn.yaml",
        "CN",
        sealing__required=False,
        privacy__max_lifetime_epsilon=0.5,
        privacy__releases="any",  # the exact count's run below is not refused for it
    )
    node = cn_node(demo_root, tmp_path / "state", policy)
    reason = declined(run(node, {"count-noise": 0.0})).reason
    assert "would raise the dataset's epsilon to" in reason
    assert "over 0.5 (privacy.max_lifetime_epsilon)" in reason
    assert "epsilon budget 8 > 0.5 (privacy.max_lifetime_epsilon)" in reason
    assert not (tmp_path / "state" / "privacy-ledger.jsonl").exists()
    # With a DP count the policy is checked before the count is drawn: a run it refuses
    # releases nothing, not even the count.
    reason = declined(run(node)).reason
    assert "epsilon budget 8 > 0.5 (privacy.max_lifetime_epsilon)" in reason
    assert not (tmp_path / "state" / "privacy-ledger.jsonl").exists()


def test_the_shipped_eu_policy_declines_a_record_level_run_before_training(
    run, demo_root, tmp_path
):
    """GDPR protects persons (privacy.unit: user): a record-level run trains nothing."""
    node = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path),
        "policy": str(ROOT / "policies" / "eu-gdpr.yaml"),
    }
    reason = declined(run(node, {"privacy-unit": "record"})).reason
    assert "eu-gdpr.yaml" in reason
    assert "privacy unit record, policy requires user (privacy.unit)" in reason
    assert not (tmp_path / LEDGER_FILE).exists()  # nothing trained, nothing accounted
    records = load_records(tmp_path / "audit.jsonl")
    (decision,) = [r for r in records if r["event"] == "policy_decision"]
    assert decision["details"]["outcome"] == "decline"
    assert not [r for r in records if r["event"] == "trained"]


def test_a_round_declares_its_privacy_unit_in_the_reply_the_ledger_and_the_log(
    run, demo_root, tmp_path
):
    unit = app_config()["privacy-unit"]  # the demo's: user
    assert unit == "user"
    clear = run(cn_node(demo_root, tmp_path)).outcome
    assert isinstance(clear, Clear) and clear.info[PRIVACY_UNIT] == unit
    assert PrivacyLedger.load(tmp_path / LEDGER_FILE).header.unit == unit
    (trained,) = [r for r in load_records(tmp_path / "audit.jsonl") if r["event"] == "trained"]
    assert trained["details"]["unit"] == unit


EU_TEXT = (ROOT / "policies" / "eu-gdpr.yaml").read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (EU_TEXT.replace("dp_required: true", "dp_required: [true"), r"YAML syntax error"),
        (
            EU_TEXT.replace("min_regions: 2", "min_regions: two"),
            r"aggregation\.min_regions: Input should be a valid integer",
        ),
        (EU_TEXT.replace("audit:", "audit:\n  shred: true"), r"audit\.shred: Extra inputs"),
        (EU_TEXT.replace("  max_delta: 1.0e-5\n", ""), r"privacy\.max_delta: Field required"),
        (EU_TEXT.replace("jurisdiction: EU", "jurisdiction: XX"), r"jurisdiction: .*unknown"),
        ("", r"the policy file is empty"),
    ],
    ids=["syntax", "type", "unknown-field", "missing-field", "unknown-jurisdiction", "empty"],
)
def test_a_malformed_policy_names_file_line_field_and_the_region_does_not_train(
    run, demo_root, tmp_path, content, message
):
    policy = tmp_path / "eu.yaml"
    policy.write_text(content)
    node = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path / "state"),
        "policy": str(policy),
    }
    reason = declined(run(node)).reason
    assert re.search(rf"{re.escape(str(policy))}:\d+: {message}", reason), reason
    assert not (tmp_path / "state" / "privacy-ledger.jsonl").exists()


def test_a_deployed_region_without_a_policy_sends_nothing_whatever_the_run_config_says(
    run, demo_root, tmp_path
):
    node = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path),  # not data-path/.fedciuic, in the shared corpora
        "policy": "",
    }
    reply = run(node, {"enforce-policies": False})
    assert "agent config:policy: not set" in declined(reply).reason


def test_a_decline_is_logged_with_every_reason_and_paths_redacted(run, demo_root, tmp_path):
    node = cn_node(demo_root, tmp_path, ROOT / "policies" / "cn-pipl.yaml")
    (tmp_path / "privacy-ledger.jsonl").write_text('{"kind": "header"}\n')
    declined(run(node))
    records = load_records(tmp_path / "audit.jsonl")
    logged = [r for r in records if r["event"] == "declined"][-1]
    assert "corrupted ledger record" in logged["details"]["reason"]
    assert str(tmp_path) not in (tmp_path / "audit.jsonl").read_text()
    assert "<state-path>/privacy-ledger.jsonl" in logged["details"]["reason"]
    assert records[-1]["event"] == "checkpoint"


# -- witnessing ------------------------------------------------------------------------------


def test_the_region_records_the_aggregators_signed_head(run, demo_root, tmp_path, keys_dir):
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(
        cn_node(demo_root, tmp_path),
        run_overrides,
        kind=TaskKind.EVALUATE,
        signer=aggregator.keypair,
        witness=(5, HEAD),
    )
    assert isinstance(reply.outcome, Evaluated) and reply.keypair is not None
    records = load_records(tmp_path / "audit.jsonl")
    witnessed = [r["details"] for r in records if r["event"] == "witness"]
    assert witnessed == [{"party": "aggregator", "count": 5, "head": HEAD}]
    assert records[-1]["event"] == "checkpoint"
    assert reply.witness == (records[-1]["details"]["count"], records[-1]["details"]["head"])


def test_the_run_end_notice_is_witnessed_signed_and_answered(
    demo_root, tmp_path, keys_dir, policies
):
    node_config = {
        "region": "eu",
        "data-path": str(demo_root / "eu"),
        "state-path": str(tmp_path),
        "policy": str(policies / "eu.yaml"),
    }
    settings = {**unit_config(), "seal": True, "keys-dir": str(keys_dir)}
    aggregator = aggregator_keys(str(keys_dir), 2**28)
    notice = signed_run_end(aggregator.keypair, FLOWER_RUN, settings, (9, HEAD), recipient="eu")
    run_cfg, node = read_configs(notice, node_config)
    reply = witness_run_end(run_cfg, node, notice, flower_run=FLOWER_RUN)
    assert reply.outcome == RunEndWitnessed("eu")
    assert reply.keypair is not None and reply.keypair.bundle.party == "eu"
    assert reply.server_round == 0
    records = load_records(tmp_path / "audit.jsonl")
    assert records[-2]["event"] == "witness" and records[-2]["details"]["count"] == 9
    assert records[-1]["event"] == "checkpoint"  # the witness is signed, not a dangling tail
    assert reply.witness == (records[-1]["details"]["count"], records[-1]["details"]["head"])
    assert verify(tmp_path / "audit.jsonl", load_bundle(keys_dir / "eu.pub.json")).ok
    forged = replace(notice, witness=(10, HEAD))
    refused = witness_run_end(run_cfg, node, forged, flower_run=FLOWER_RUN)
    assert "not signed by the aggregator" in declined(refused).reason
    assert refused.keypair is None and refused.witness is None


def test_a_release_the_run_end_receipts_do_not_list_is_recorded_undelivered_once(
    run, demo_root, tmp_path, keys_dir, policies
):
    """The region trained and sealed round 1; the aggregator's signed run-end notice
    lists no receipt of it (the reply came too late): the region's own log says so, and
    once, however often the notice comes."""
    run_overrides, aggregator = sealed_run(keys_dir)
    reply = run(cn_node(demo_root, tmp_path), run_overrides, signer=aggregator.keypair)
    assert isinstance(reply.outcome, Sealed)
    (sent,) = [r for r in load_records(tmp_path / "audit.jsonl") if r["event"] == "update_sealed"]
    node_config = {**cn_node(demo_root, tmp_path), "policy": str(policies / "cn.yaml")}
    settings = {**unit_config(), "local-steps": 2, "seal": False, **run_overrides}

    def notice(receipts: dict[str, list[list[object]]]) -> RunEndNotice:
        signed: RunEndNotice = signed_run_end(
            aggregator.keypair, FLOWER_RUN, settings, (9, HEAD), receipts, recipient="cn"
        )
        return signed

    def undelivered() -> list[dict[str, Any]]:
        records = load_records(tmp_path / "audit.jsonl")
        return [r for r in records if r["event"] == "update_undelivered"]

    delivered = notice({"cn": [[1, sent["details"]["digest"]]]})
    run_cfg, node = read_configs(delivered, node_config)
    assert witness_run_end(
        run_cfg, node, delivered, flower_run=FLOWER_RUN
    ).outcome == RunEndWitnessed("cn")
    assert undelivered() == []
    missing = notice({"cn": [], "eu": [[1, sent["details"]["digest"]]]})  # another region's
    for _ in range(2):
        assert witness_run_end(run_cfg, node, missing, flower_run=FLOWER_RUN).outcome == (
            RunEndWitnessed("cn")
        )
    (record,) = undelivered()
    assert record["round"] == 1 and record["details"]["digest"] == sent["details"]["digest"]
    assert "no receipt" in record["details"]["reason"]
    # The receipts are signed: a relay cannot make a delivered update look lost.
    forged = replace(delivered, receipts=json.dumps({"cn": []}))
    assert (
        "not signed"
        in declined(witness_run_end(run_cfg, node, forged, flower_run=FLOWER_RUN)).reason
    )


def test_a_training_round_opens_its_ledger_once(run, demo_root, tmp_path, monkeypatch):
    """The projection for the policy check, the release check and the training read one
    ledger, opened (and its audit-log witness read) once, under one lock."""
    from fedciuic.privacy import ledger as ledger_module

    opened: list[Path] = []
    real = ledger_module.PrivacyLedger.open

    def counting(path, **kwargs):
        opened.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(ledger_module.PrivacyLedger, "open", staticmethod(counting))
    node = cn_node(demo_root, tmp_path)
    assert isinstance(run(node).outcome, Clear)
    assert opened == [tmp_path / "privacy-ledger.jsonl"]
    opened.clear()  # a resent round (its update kept) opens it once, to see it released
    assert isinstance(run(node).outcome, Clear)
    assert opened == [tmp_path / "privacy-ledger.jsonl"]


def test_a_dp_only_policy_declines_a_run_with_data_figures_naming_the_fields_not_values(
    run, demo_root, tmp_path
):
    """privacy.releases: dp_only: the run's trained replies would carry the example count
    outside DP, so the region trains and evaluates nothing. Its policy's refusal leaves
    (it names fields and the policy key, no figure of the data: public_reason); a reason
    that may carry the data's figures stays in the region's own log."""
    policy = write_policy(
        tmp_path / "cn.yaml", "CN", sealing__required=False, privacy__releases="dp_only"
    )
    state = tmp_path / "state"
    for kind in (TaskKind.TRAIN, TaskKind.EVALUATE):
        reply = run(cn_node(demo_root, state, policy), EXACT_RELEASES, kind=kind)
        reason = declined(reply).reason
        assert region_records(reply).info["reason"] == reason
        assert "(privacy.releases: dp_only)" in reason
        assert "num-examples: the region's training example count" in reason
    assert not (state / LEDGER_FILE).exists()  # nothing trained, nothing accounted
    # A ledger that cannot be read: the reason names the file's state, so it stays home.
    (state / LEDGER_FILE).write_text('{"kind": "header"}\n')
    reply = run(cn_node(demo_root, state, policy))
    assert declined(reply).reason == WITHHELD_REASON
    said = [r for r in load_records(state / "audit.jsonl") if r["event"] == "declined"]
    assert len(said) == 3 and "corrupted ledger record" in said[-1]["details"]["reason"]


def test_a_dp_only_region_withholds_an_exact_evaluation_and_still_trains(run, demo_root, tmp_path):
    """With the DP count but an exact held-out loss (eval-noise = 0), a dp_only region
    declines each evaluation, saying why in words of the policy and the run config only,
    and trains; its log records that nothing left outside DP."""
    policy = write_policy(
        tmp_path / "cn.yaml", "CN", sealing__required=False, privacy__releases="dp_only"
    )
    state = tmp_path / "state"
    node = cn_node(demo_root, state, policy)
    settings = {"count-noise": 5.0, "eval-noise": 0.0, "codec": "int8"}
    reason = declined(run(node, settings, kind=TaskKind.EVALUATE)).reason
    assert reason.startswith("region cn: evaluation withheld: the run's held-out loss")
    assert "eval-loss: the global adapter's mean loss" in reason
    assert "set eval-noise > 0" in reason
    trained = run(node, settings)
    assert isinstance(trained.outcome, Clear), trained.outcome
    assert "train-loss" not in trained.outcome.metrics
    records = load_records(state / "audit.jsonl")
    assert not [r for r in records if r["event"] == "evaluated"]  # nothing evaluated
    (noted,) = [r for r in records if r["event"] == "trained"]
    assert noted["details"]["outside_dp"] == []


def test_a_region_records_the_figures_of_its_data_it_sent(run, demo_root, tmp_path):
    """Without dp_only, in a run of exact counts and evaluations, what left outside DP is
    on the region's own log, field by field (the compliance report lists it)."""
    state = tmp_path / "state"
    node = cn_node(demo_root, state)
    run(node, EXACT_RELEASES, kind=TaskKind.EVALUATE)
    trained = run(node, EXACT_RELEASES)
    assert "train-loss" in trained.outcome.metrics
    records = load_records(state / "audit.jsonl")
    (evaluated_record,) = [r for r in records if r["event"] == "evaluated"]
    assert {"num-examples", "eval-loss", "step-seconds"} <= set(
        evaluated_record["details"]["outside_dp"]
    )
    (noted,) = [r for r in records if r["event"] == "trained"]
    assert {"num-examples", "train-loss", "epsilon", "sample-rate"} <= set(
        noted["details"]["outside_dp"]
    )


def test_with_count_noise_a_run_releases_its_dp_count_first_and_samples_at_its_rate(
    run, demo_root, tmp_path
):
    """count-noise: the run's DP count of units is its own release (a ledger line, charged,
    witnessed on the region's log) before the round; the round's rate, noise, epsilon
    and weight follow from it, not from the exact count."""
    state = tmp_path / "state"
    reply = run(cn_node(demo_root, state), {"count-noise": 5.0, "batch-size": 4})
    assert isinstance(reply.outcome, Clear), reply.outcome
    metrics = reply.outcome.metrics
    ledger = PrivacyLedger.load(state / LEDGER_FILE)
    counted, trained = ledger.rounds
    assert (counted.purpose, trained.purpose) == ("counts", "training")
    assert counted.noise_multiplier == 5.0 and counted.sample_rate == 1.0
    assert counted.count is not None and metrics["num-examples"] == counted.count  # its weight
    assert metrics["sample-rate"] == pytest.approx(1 / -(-max(counted.count, 4) // 4))
    assert trained.sample_rate == metrics["sample-rate"]
    assert metrics["epsilon"] == pytest.approx(ledger.epsilon)  # the count included
    records = load_records(state / "audit.jsonl")
    (noted,) = [r for r in records if r["event"] == "units_counted"]
    assert noted["details"]["count"] == counted.count
    assert noted["details"]["ledger"]["releases"] == 1
    (released,) = [r for r in records if r["event"] == "trained"]
    assert released["details"]["ledger"]["releases"] == 2


def test_with_eval_noise_an_evaluation_is_a_dp_release_charged_to_the_ledger(
    run, demo_root, tmp_path
):
    state = tmp_path / "state"
    reply = run(cn_node(demo_root, state), {"eval-noise": 2.0}, kind=TaskKind.EVALUATE)
    assert isinstance(reply.outcome, Evaluated), reply.outcome
    stats = reply.outcome.stats
    assert 0.0 <= stats.loss <= 10.0 and stats.num_examples >= 1  # clipped, post-processed
    ledger = PrivacyLedger.load(state / LEDGER_FILE)
    (line,) = ledger.rounds
    assert (line.purpose, line.sample_rate) == ("evaluation", 1.0)
    assert line.noise_multiplier == pytest.approx(2.0 / 2**0.5)  # a sum and a count
    (noted,) = [r for r in load_records(state / "audit.jsonl") if r["event"] == "evaluated"]
    assert noted["details"]["ledger"]["releases"] == 1
    assert noted["details"]["epsilon"] == pytest.approx(ledger.epsilon)


def test_a_dp_only_region_takes_part_when_every_figure_it_sends_is_dp_or_public(
    run, demo_root, tmp_path, monkeypatch
):
    """privacy.releases: dp_only with count-noise and eval-noise: the region evaluates
    and trains, and what leaves carries no figure of its data (no train-loss, no
    step-seconds, its data named by a commitment); no step is timed for step-seconds
    it would not send."""
    timed: list[object] = []
    monkeypatch.setattr(training_module, "time_private_step", lambda *a, **k: timed.append(a))
    policy = write_policy(
        tmp_path / "cn.yaml", "CN", sealing__required=False, privacy__releases="dp_only"
    )
    state = tmp_path / "state"
    node = cn_node(demo_root, state, policy)
    settings = {"count-noise": 5.0, "eval-noise": 20.0, "codec": "int8"}
    evaluated = run(node, settings, kind=TaskKind.EVALUATE)
    assert isinstance(evaluated.outcome, Evaluated), evaluated.outcome
    assert "step-seconds" not in region_records(evaluated).metrics
    assert timed == []
    trained = run(node, settings)
    declines = [r for r in load_records(state / "audit.jsonl") if r["event"] == "declined"]
    assert isinstance(trained.outcome, Clear), declines
    assert "train-loss" not in trained.outcome.metrics
    records = load_records(state / "audit.jsonl")
    (noted,) = [r for r in records if r["event"] == "trained"]
    sent = trained.outcome.info["data-fingerprint"]
    assert len(sent) == 64 and sent != noted["details"]["data_fingerprint"]  # a commitment
    purposes = [r.purpose for r in PrivacyLedger.load(state / LEDGER_FILE).rounds]
    assert purposes == ["evaluation", "counts", "training"]
    for event in ("evaluated", "trained"):  # nothing left outside DP, on its own record
        (record,) = [r for r in records if r["event"] == event]
        assert record["details"]["outside_dp"] == []


def test_a_regions_own_physical_batch_is_the_one_its_dp_steps_pass_in(
    run, demo_root, tmp_path, monkeypatch
):
    """max-physical-batch-size is the region's memory's to decide: its node (agent)
    config's wins over the run config's, which applies where it says none."""
    passes: list[int] = []
    real = dpsgd.private_round

    def spy(model: Any, examples: Any, local: Any, *args: Any, **kwargs: Any) -> Any:
        passes.append(local.max_physical_batch_size)
        return real(model, examples, local, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "private_round", spy)
    settings = {"max-physical-batch-size": 3}
    for state, own in (("run's", {}), ("own", {"max-physical-batch-size": 1})):
        reply = run({**cn_node(demo_root, tmp_path / state), **own}, settings)
        assert isinstance(reply.outcome, Clear), reply.outcome
    assert passes == [3, 1]
