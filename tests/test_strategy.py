"""RegionalFedAvg without Flower processes: fake replies, a fake grid and a fake clock."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict

from fedciuic.audit.log import AuditLog, load_records, verify
from fedciuic.compression import get_codec
from fedciuic.crypto.envelope import seal
from fedciuic.crypto.keys import KeyFileError, Keypair, load_keypair
from fedciuic.crypto.sealing import (
    RegionKeys,
    aggregator_keys,
    generate_federation_keys,
    update_payload,
)
from fedciuic.errors import FederationError
from fedciuic.flower import protocol
from fedciuic.model.train import EvalStats, TrainStats
from fedciuic.ops.outputs import RunRecorder, summarize
from fedciuic.policy.binding import AggregatorPolicies
from fedciuic.policy.rules import PolicyError, load_policy
from fedciuic.rounds.checkpoint import load_checkpoint
from fedciuic.rounds.region import TrainOutcome
from server.strategy import RegionalFedAvg
from tests.conftest import write_policy

GLOBAL = {"w": np.zeros(4, np.float32)}


pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture
def strategy(run_config, tmp_path) -> RegionalFedAvg:
    recorder = RunRecorder(tmp_path / "run", {"run_id": 7, "regions": list(run_config.regions)})
    dense = run_config.model_copy(update={"codec": "dense"})  # updates below are dense
    s = RegionalFedAvg(dense, base_fingerprint="f" * 64, recorder=recorder)
    s.global_adapter = {k: v.copy() for k, v in GLOBAL.items()}
    return s


def reply(node_id: int, content: RecordDict | Error, kind: str = MessageType.TRAIN) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=kind)
    if isinstance(content, Error):
        return Message(content, reply_to=instruction)
    return Message(content, reply_to=instruction)


def encoded(value: float, n: int = 4) -> bytes:
    """A dense-codec update of ``n`` entries, all ``value`` (the run's codec is dense)."""
    return get_codec("dense").encode(np.full(n, value, np.float32), np.random.default_rng(0))


def trained(region: str, value: float, examples: int, n: int = 4) -> RecordDict:
    delta = {"w": np.full(n, value, np.float32)}
    outcome = TrainOutcome(
        region, delta, TrainStats(1.0, 5, examples), "fp-" + region, update=encoded(value, n)
    )
    return protocol.train_reply(outcome)


def test_deltas_are_averaged_by_examples_and_applied(strategy):
    arrays, metrics = strategy.aggregate_train(
        1, [reply(11, trained("eu", 1.0, 10)), reply(12, trained("cn", 4.0, 30))]
    )
    assert arrays is not None and metrics is not None
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 0.25 * 1 + 0.75 * 4)
    assert metrics["regions"] == 2


def test_a_decline_is_recorded_and_the_others_are_aggregated(strategy, tmp_path):
    arrays, _ = strategy.aggregate_train(
        1,
        [
            reply(11, trained("eu", 2.0, 10)),
            reply(12, protocol.decline_reply("cn", "budget spent")),
        ],
    )
    assert arrays is not None
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 2.0)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["rounds"]["1"]["train"]["cn"] == {"status": "declined", "reason": "budget spent"}
    assert saved["rounds"]["1"]["train"]["eu"]["data_fingerprint"] == "fp-eu"


def test_failed_and_malformed_replies_are_rejected_alone(strategy):
    bad_shape = trained("us", 1.0, 10, n=5)  # one entry too many for the adapter
    nan = trained("cn", float("nan"), 10)
    arrays, _ = strategy.aggregate_train(
        1,
        [
            reply(11, trained("eu", 1.0, 10)),
            reply(12, nan),
            reply(13, bad_shape),
            reply(14, Error(code=0, reason="process died")),
            reply(15, RecordDict({"junk": ConfigRecord({"x": 1})})),
        ],
    )
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 1.0)
    train = strategy.recorder.data["rounds"]["1"]["train"]
    assert train["cn"]["status"] == "rejected" and "NaN" in train["cn"]["reason"]
    assert train["us"]["status"] == "rejected"
    assert "update has 5 entries, the adapter has 4" in train["us"]["reason"]
    assert train["node-14"] == {"status": "failed", "reason": "process died"}
    assert train["node-15"]["status"] == "rejected"
    assert "MalformedReply" in train["node-15"]["reason"]


def test_round_where_every_region_declines_leaves_the_model_unchanged(strategy):
    arrays, metrics = strategy.aggregate_train(1, [reply(11, protocol.decline_reply("eu", "no"))])
    assert arrays is None and metrics is None
    np.testing.assert_array_equal(strategy.global_adapter["w"], GLOBAL["w"])
    assert strategy.recorder.data["rounds"]["1"]["aggregate"]["published"] is False


def test_evaluation_is_recorded_per_region_and_overall(strategy):
    replies = [
        reply(11, protocol.evaluate_reply("eu", EvalStats(2.0, 10)), MessageType.EVALUATE),
        reply(12, protocol.evaluate_reply("cn", EvalStats(4.0, 30)), MessageType.EVALUATE),
    ]
    metrics = strategy.aggregate_evaluate(0, replies)
    assert metrics is not None and metrics["eval-loss"] == pytest.approx(3.5)
    evals = strategy.recorder.data["rounds"]["0"]["eval"]
    assert evals["eu"]["loss"] == 2.0 and evals["overall"]["num_examples"] == 40


class FakeGrid:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def test_waiting_for_missing_regions_ends_at_the_deadline(strategy, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("server.strategy.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    strategy.clock = lambda: now[0]
    strategy.run = strategy.run.model_copy(update={"min_regions": 2, "node_wait_timeout": 5.0})
    with pytest.raises(FederationError, match=r"only 1 of 3 regions connected within 5s"):
        strategy.wait_for_regions(FakeGrid([1]))
    assert now[0] == pytest.approx(5.0, abs=1.0)


def test_enough_regions_after_the_deadline_go_ahead(strategy, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("server.strategy.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    strategy.clock = lambda: now[0]
    assert strategy.wait_for_regions(FakeGrid([3, 1])) == [1, 3]


def test_instruction_round_trip():
    content = protocol.instruction(
        protocol.pack_arrays(GLOBAL), server_round=3, base_fingerprint="abc", config=ConfigRecord()
    )
    message = Message(content, dst_node_id=2, message_type=MessageType.TRAIN)
    task = protocol.read_instruction(message)
    assert task.server_round == 3 and task.base_fingerprint == "abc"
    np.testing.assert_array_equal(task.adapter["w"], GLOBAL["w"])


def test_only_the_first_round_waits_for_missing_regions(strategy, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("server.strategy.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    strategy.clock = lambda: now[0]
    strategy.wait_for_regions(FakeGrid([1, 2]))
    waited = now[0]
    assert waited >= strategy.run.node_wait_timeout
    assert strategy.wait_for_regions(FakeGrid([1, 2])) == [1, 2]
    assert now[0] == waited  # no second wait


# -- sealed updates --------------------------------------------------------------------


@pytest.fixture
def sealed_strategy(run_config, tmp_path) -> tuple[RegionalFedAvg, dict[str, Keypair]]:
    keys_dir = generate_federation_keys(tmp_path / "keys", ("eu", "cn", "us"))
    recorder = RunRecorder(tmp_path / "run", {"run_id": 7, "regions": list(run_config.regions)})
    s = RegionalFedAvg(
        run_config.model_copy(update={"codec": "dense"}),
        base_fingerprint="f" * 64,
        recorder=recorder,
        keys=aggregator_keys(str(keys_dir), 2**20),
        run_id=7,
    )
    s.global_adapter = {k: v.copy() for k, v in GLOBAL.items()}
    regions = {r: load_keypair(keys_dir / f"{r}.key.json") for r in ("eu", "cn", "us")}
    return s, regions


def sealed_reply_from(
    keypair: Keypair,
    aggregator,
    value: float,
    server_round: int = 1,
    run_id: int = 7,
    metrics: dict[str, float] | None = None,
    policy_hash: str = "",
    suite: str = "xwing-aes256gcm",
    n: int = 4,
    signed_round: int | None = None,
    signed_run: int | None = None,
) -> RecordDict:
    """A sealed reply as a region sends it; ``signed_*``: the run and round its reply
    signature names, when they differ from its envelope's (a relayed old envelope)."""
    region = keypair.bundle.party
    payload = update_payload(
        protocol.update_arrays(encoded(value, n)),
        metrics or {"num-examples": 10, "train-loss": 1.0, "steps": 1, "update-bytes": 16},
        {
            "region": region,
            "status": "trained",
            "reason": "",
            "data-fingerprint": "fp",
            "jurisdiction": "",
            "policy-hash": policy_hash,
        },
    )
    envelope = seal(
        payload,
        sender=keypair,
        recipient=aggregator,
        run_id=run_id,
        server_round=server_round,
        region=region,
        policy_hash=bytes.fromhex(policy_hash),
        suite=suite,  # type: ignore[arg-type]
    )
    content = protocol.sealed_reply(region, envelope, keypair.bundle.key_id.hex())
    return protocol.sign_reply(
        content,
        keypair,
        run_id=run_id if signed_run is None else signed_run,
        server_round=server_round if signed_round is None else signed_round,
    )


def test_sealed_updates_are_opened_and_aggregated(sealed_strategy):
    s, regions = sealed_strategy
    agg = s.keys.keypair.bundle
    arrays, _ = s.aggregate_train(
        1,
        [
            reply(11, sealed_reply_from(regions["eu"], agg, 1.0)),
            reply(12, sealed_reply_from(regions["cn"], agg, 3.0)),
        ],
    )
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 2.0)


def test_sealed_path_rejects_replays_wrong_rounds_tampering_and_clear_updates(sealed_strategy):
    s, regions = sealed_strategy
    agg = s.keys.keypair.bundle
    good = sealed_reply_from(regions["eu"], agg, 1.0)
    arrays, _ = s.aggregate_train(
        1,
        [
            reply(11, good),
            reply(12, good),  # the same envelope again
            reply(13, sealed_reply_from(regions["cn"], agg, 9.0, server_round=2)),
            reply(14, tampered(sealed_reply_from(regions["us"], agg, 5.0))),
            reply(15, trained("us", 7.0, 10)),  # in the clear
        ],
    )
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 1.0)  # only eu's
    train = s.recorder.data["rounds"]["1"]["train"]
    assert train["eu"]["status"] == "trained"
    # signed for round 2: its reply signature does not verify in round 1, so nothing
    # authenticates it as cn's and it is recorded under its node, its claim noted
    assert train["node-13"] == {
        "status": "rejected",
        "reason": "InvalidEnvelope: invalid envelope",
        "claimed_region": "cn",
    }
    # tampered envelope in a reply us signed: us's reply, rejected
    assert train["us"] == {"status": "rejected", "reason": "InvalidEnvelope: invalid envelope"}
    # an unsigned update in the clear while sealing is on: nothing authenticates it
    assert train["node-15"]["status"] == "rejected"
    assert train["node-15"]["claimed_region"] == "us"
    duplicates = s.recorder.data["rounds"]["1"]["duplicates"]
    assert duplicates == [
        {
            "region": "eu",
            "status": "rejected",
            "reason": "EnvelopeRejected: replay: a second envelope from eu in round 1",
        },
    ]


def test_global_adapter_is_signed_for_each_round(sealed_strategy):
    s, regions = sealed_strategy
    content = next(
        iter(
            s._messages(
                FakeGrid([1, 2, 3]),
                protocol.pack_arrays(GLOBAL),
                ConfigRecord(),
                4,
                MessageType.TRAIN,
            )
        )
    ).content
    task = protocol.read_instruction(Message(content, dst_node_id=1, message_type="train"))
    keys = RegionKeys(regions["eu"], s.keys.keypair.bundle, "xwing-aes256gcm")
    keys.check_global(task.signature, task.signer, 7, 4, task.adapter)  # valid
    with pytest.raises(KeyFileError, match="not signed by the aggregator"):
        keys.check_global(task.signature, task.signer, 7, 5, task.adapter)  # another round


# -- jurisdiction policies ------------------------------------------------------------

DP_METRICS = {
    "num-examples": 60,
    "train-loss": 1.0,
    "steps": 5,
    "update-bytes": 16,
    "epsilon": 7.9,
    "epsilon-budget": 10.0,
    "delta": 1e-5,
    "noise-multiplier": 1.1,
    "sample-rate": 0.1,
    "max-grad-norm": 1.0,
    "secure-mode": 1,
}
NO_DP = dict.fromkeys(
    (
        "epsilon",
        "epsilon-budget",
        "delta",
        "noise-multiplier",
        "sample-rate",
        "max-grad-norm",
        "secure-mode",
    )
)


@pytest.fixture
def policed(sealed_strategy, tmp_path) -> tuple[RegionalFedAvg, dict[str, Keypair], Path]:
    """The sealed strategy holding the shipped EU, CN and US policies (aggregator in EU)."""
    s, regions = sealed_strategy
    folder = tmp_path / "policies"
    for jurisdiction in ("EU", "CN", "US"):
        write_policy(folder / f"{jurisdiction.lower()}.yaml", jurisdiction)
    s.policies = AggregatorPolicies.load(s.run.model_copy(update={"policies_dir": str(folder)}))
    return s, regions, folder


def policy_hash(folder: Path, region: str) -> str:
    return load_policy(folder / f"{region}.yaml").hash


def from_region(
    policed,
    region: str,
    value: float,
    n: int = 4,
    server_round: int = 1,
    run_id: int = 7,
    signed_round: int | None = None,
    signed_run: int | None = None,
    **changes,
) -> RecordDict:
    s, regions, folder = policed
    metrics = {k: v for k, v in {**DP_METRICS, **changes}.items() if v is not None}
    return sealed_reply_from(
        regions[region],
        s.keys.keypair.bundle,
        value,
        metrics=metrics,
        policy_hash=policy_hash(folder, region),
        n=n,
        server_round=server_round,
        run_id=run_id,
        signed_round=signed_round,
        signed_run=signed_run,
    )


def tampered(content: RecordDict) -> RecordDict:
    raw = bytearray(content.array_records[protocol.ARRAYS][protocol.ENVELOPE].numpy().tobytes())
    raw[-100] ^= 1
    content[protocol.ARRAYS] = ArrayRecord(
        {protocol.ENVELOPE: protocol.pack_arrays({"e": np.frombuffer(bytes(raw), np.uint8)})["e"]}
    )
    return content


def test_updates_within_their_senders_policies_are_aggregated(policed):
    s = policed[0]
    arrays, _ = s.aggregate_train(
        1, [reply(11, from_region(policed, "eu", 1.0)), reply(12, from_region(policed, "cn", 3.0))]
    )
    assert arrays is not None
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 2.0)
    decisions = s.recorder.data["rounds"]["1"]["decisions"]
    assert [d["outcome"] for d in decisions] == ["accept", "accept", "accept"]
    assert decisions[0]["policy_hash"] == policy_hash(policed[2], "eu")
    assert decisions[2]["subject"] == "aggregate"


def test_an_update_whose_declared_epsilon_exceeds_its_senders_policy_is_rejected(policed):
    s = policed[0]
    s.aggregate_train(
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, epsilon=9.5)),
        ],
    )
    entry = s.recorder.data["rounds"]["1"]["train"]["cn"]
    assert entry["status"] == "rejected"
    assert "declared epsilon 9.5 > 8 (privacy.max_lifetime_epsilon)" in entry["reason"]


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"delta": 1e-3}, "delta 0.001 > 1e-05 (privacy.max_delta)"),
        ({"max-grad-norm": 3.0}, "clipping norm 3 > 1 (privacy.max_clipping_norm)"),
        (NO_DP, "no DP epsilon declared (privacy.dp_required)"),
    ],
)
def test_updates_breaking_their_senders_privacy_rules_are_rejected(policed, changes, rule):
    s = policed[0]
    s.aggregate_train(1, [reply(12, from_region(policed, "cn", 3.0, **changes))])
    entry = s.recorder.data["rounds"]["1"]["train"]["cn"]
    assert entry["status"] == "rejected" and rule in entry["reason"]


def test_a_header_naming_another_policy_or_a_forbidden_suite_is_rejected(policed):
    s, regions, folder = policed
    agg = s.keys.keypair.bundle
    wrong_policy = sealed_reply_from(
        regions["eu"], agg, 1.0, metrics=DP_METRICS, policy_hash=policy_hash(folder, "us")
    )
    fernet = sealed_reply_from(
        regions["cn"],
        agg,
        1.0,
        metrics=DP_METRICS,
        policy_hash=policy_hash(folder, "cn"),
        suite="xwing-fernet",
    )
    s.aggregate_train(1, [reply(11, wrong_policy), reply(12, fernet)])
    train = s.recorder.data["rounds"]["1"]["train"]
    assert "the aggregator holds" in train["eu"]["reason"]
    assert "suite xwing-fernet not allowed (sealing.allowed_suites)" in train["cn"]["reason"]


def test_an_unsealed_update_is_rejected_where_the_policy_requires_sealing(strategy, tmp_path):
    folder = tmp_path / "policies"
    write_policy(folder / "eu.yaml", "EU")
    strategy.policies = AggregatorPolicies.load(
        strategy.run.model_copy(update={"policies_dir": str(folder)})
    )
    clear = trained("eu", 1.0, 60)
    clear.config_records["info"]["jurisdiction"] = "EU"
    arrays, _ = strategy.aggregate_train(1, [reply(11, clear)])
    assert arrays is None
    entry = strategy.recorder.data["rounds"]["1"]["train"]["eu"]
    assert entry["status"] == "rejected"
    assert "the update came unsealed (sealing.required)" in entry["reason"]


def test_a_refused_aggregate_leaves_the_global_model_unchanged(policed):
    s = policed[0]
    before = {k: v.copy() for k, v in s.global_adapter.items()}
    # One region accepted, the other rejected: the shipped policies need 2 regions.
    arrays, metrics = s.aggregate_train(
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, epsilon=20.0)),
        ],
    )
    assert arrays is None and metrics is None
    np.testing.assert_array_equal(s.global_adapter["w"], before["w"])
    aggregate = s.recorder.data["rounds"]["1"]["aggregate"]
    assert aggregate["published"] is False and aggregate["regions"] == ["eu"]
    assert "the strictest policy needs 2 (aggregation.min_regions)" in aggregate["reasons"][0]
    assert "the strictest policy needs 100 (aggregation.min_examples)" in aggregate["reasons"][1]


def test_too_few_examples_withhold_the_aggregate(policed):
    s = policed[0]
    arrays, _ = s.aggregate_train(
        1,
        [
            reply(11, from_region(policed, "eu", 1.0, **{"num-examples": 20})),
            reply(12, from_region(policed, "cn", 3.0, **{"num-examples": 20})),
        ],
    )
    assert arrays is None
    reasons = s.recorder.data["rounds"]["1"]["aggregate"]["reasons"]
    assert reasons == [
        "40 examples in the aggregate, the strictest policy needs 100 (aggregation.min_examples)"
    ]


def test_a_region_whose_policy_the_aggregator_cannot_read_is_rejected(policed):
    s, _, folder = policed
    update = from_region(policed, "cn", 3.0)
    (folder / "cn.yaml").write_text("version: 1\njurisdiction: CN\n")
    s.policies = AggregatorPolicies.load(s.run.model_copy(update={"policies_dir": str(folder)}))
    s.aggregate_train(1, [reply(12, update)])
    entry = s.recorder.data["rounds"]["1"]["train"]["cn"]
    assert entry["status"] == "rejected"
    assert "no readable policy for CN" in entry["reason"] and "cn.yaml:1" in entry["reason"]


def test_the_aggregator_refuses_to_start_without_policies_or_in_the_wrong_place(
    run_config, tmp_path
):
    from server.app import _policies

    recorder = RunRecorder(tmp_path / "run", {"run_id": 7})
    keys = aggregator_keys(str(generate_federation_keys(tmp_path / "keys", ("eu",), "US")), 2**20)
    with pytest.raises(PolicyError, match="run config:policies-dir: empty"):
        _policies(run_config.model_copy(update={"policies_dir": ""}), None, recorder)
    with pytest.raises(PolicyError, match="aggregator-jurisdiction: EU, but the aggregator's key"):
        _policies(run_config.model_copy(update={"policies_dir": str(tmp_path)}), keys, recorder)
    assert (
        _policies(run_config.model_copy(update={"enforce_policies": False}), keys, recorder) is None
    )
    assert recorder.data["run"]["policies"] is None


def test_the_summary_names_policies_withheld_aggregates_and_refusals(policed):
    s = policed[0]
    s.recorder.data["run"].update(
        config={"aggregator-jurisdiction": "EU"},
        policies={"EU": {"file": "eu.yaml", "hash": "ab" * 32}},
        regions=["eu", "cn"],
    )
    s.aggregate_train(
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, epsilon=20.0)),
        ],
    )
    text = summarize(s.recorder.data)
    assert "policies (aggregator in EU): EU abababababab" in text
    assert "round 1: aggregate withheld, global adapter unchanged: 1 region(s)" in text
    assert "round 1: cn rejected: declared epsilon 20 > 8" in text


def test_the_aggregator_logs_each_arrival_decision_and_aggregate(policed, tmp_path):
    s = policed[0]
    s.audit = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", s.keys.keypair)
    good, bad = from_region(policed, "eu", 1.0), from_region(policed, "cn", 3.0, epsilon=20.0)
    s.aggregate_train(1, [reply(11, good), reply(12, bad)])
    records = load_records(s.audit.path)
    events = [(r["event"], r["details"].get("region")) for r in records]
    assert events == [
        ("update_received", "eu"),
        ("policy_decision", None),
        ("update_accepted", "eu"),
        ("update_received", "cn"),
        ("policy_decision", None),
        ("update_rejected", "cn"),
        ("policy_decision", None),
        ("aggregate_withheld", None),
        ("checkpoint", None),
    ]
    envelope = good.array_records["arrays"]["envelope"].numpy().tobytes()
    assert records[0]["details"]["digest"] == hashlib.sha256(envelope).hexdigest()
    assert "declared epsilon 20 > 8" in records[5]["details"]["reason"]
    assert verify(s.audit.path, s.keys.keypair.bundle).ok


# -- hostile input: rejected, audited, and the round goes on or ends explicitly ------------

HOSTILE = {
    "tampered ciphertext": (lambda p: tampered(from_region(p, "cn", 1.0)), "invalid envelope"),
    "replay from another round": (
        lambda p: from_region(p, "cn", 1.0, server_round=2, signed_round=1),
        "envelope is for round 2, this is round 1",
    ),
    "replay from another run": (
        lambda p: from_region(p, "cn", 1.0, run_id=8, signed_run=7),
        "envelope is for run 8",
    ),
    "NaN values": (lambda p: from_region(p, "cn", float("nan")), "NaN"),
    "Inf values": (lambda p: from_region(p, "cn", float("inf")), "inf"),
    "wrong shape": (lambda p: from_region(p, "cn", 1.0, n=3), "update has 3 entries"),
    "scaled by 100": (lambda p: from_region(p, "cn", 100.0), "over max-update-norm 50"),
    "oversized message": (lambda p: from_region(p, "cn", 1.0, n=300_000), "byte limit"),
    "implausible example count": (
        lambda p: from_region(p, "cn", 1.0, **{"num-examples": 10**9}),
        "over max-examples",
    ),
}


@pytest.fixture
def audited(policed, tmp_path):
    s = policed[0]
    s.audit = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", s.keys.keypair)
    return policed


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_update_is_rejected_and_audited_and_the_round_goes_on(audited, case):
    s = audited[0]
    make, reason = HOSTILE[case]
    arrays, _ = s.aggregate_train(
        1,
        [
            reply(11, from_region(audited, "eu", 1.0)),
            reply(12, make(audited)),
            reply(13, from_region(audited, "us", 3.0)),
        ],
    )
    assert arrays is not None  # eu and us meet the policies' minimums
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 2.0)
    assert s.recorder.data["rounds"]["1"]["train"]["cn"]["status"] == "rejected"
    rejected = [
        r
        for r in load_records(s.audit.path)
        if r["event"] == "update_rejected" and r["details"]["region"] == "cn"
    ]
    assert len(rejected) == 1 and reason in rejected[0]["details"]["reason"], rejected
    assert verify(s.audit.path, s.keys.keypair.bundle).ok


@pytest.mark.parametrize("case", ["NaN values", "scaled by 100", "tampered ciphertext"])
def test_below_the_minimums_the_round_ends_explicitly_and_the_model_is_untouched(audited, case):
    s = audited[0]
    before = s.global_adapter["w"].copy()
    make, _ = HOSTILE[case]
    arrays, metrics = s.aggregate_train(
        1, [reply(11, from_region(audited, "eu", 1.0)), reply(12, make(audited))]
    )
    assert arrays is None and metrics is None
    np.testing.assert_array_equal(s.global_adapter["w"], before)
    events = [r["event"] for r in load_records(s.audit.path)]
    assert "update_rejected" in events and events[-2:] == ["aggregate_withheld", "checkpoint"]


def test_a_clipped_update_is_recorded_with_its_norm(policed):
    s = policed[0]
    s.run = s.run.model_copy(update={"update_norm_action": "clip", "max_update_norm": 2.0})
    arrays, _ = s.aggregate_train(
        1,
        [reply(11, from_region(policed, "eu", 1.0)), reply(12, from_region(policed, "cn", 100.0))],
    )
    assert arrays is not None
    cn = s.recorder.data["rounds"]["1"]["train"]["cn"]
    assert cn["clipped"] is True and cn["norm"] == pytest.approx(200.0)
    # eu's delta (norm 2) is within the bound; cn's is scaled to norm 2: all ones.
    np.testing.assert_allclose(protocol.unpack_arrays(arrays)["w"], 1.0, rtol=1e-5)


# -- the round loop, checkpoints and resume --------------------------------------------


class RegionsGrid(FakeGrid):
    """Two regions that each move the adapter half-way towards their own target."""

    def __init__(self) -> None:
        self.targets = {11: ("eu", 1.0), 12: ("cn", 3.0)}
        super().__init__(list(self.targets))

    def send_and_receive(self, messages, timeout):
        replies = []
        for message in messages:
            region, target = self.targets[message.metadata.dst_node_id]
            if message.metadata.message_type == MessageType.TRAIN:
                w = protocol.unpack_arrays(message.content.array_records["arrays"])["w"]
                content = trained(region, float(0.5 * (target - w[0])), 10)
            else:
                content = protocol.evaluate_reply(region, EvalStats(1.0, 10))
            replies.append(Message(content, reply_to=message))
        return replies


def regions_grid() -> Any:
    return RegionsGrid()


def looped(run_config, folder, rounds: int) -> RegionalFedAvg:
    run = run_config.model_copy(
        update={"codec": "dense", "num_server_rounds": rounds, "regions": ("eu", "cn")}
    )
    recorder = RunRecorder(folder, {"run_id": 7, "regions": ["eu", "cn"]})
    return RegionalFedAvg(
        run,
        base_fingerprint="f" * 64,
        recorder=recorder,
        run_id=7,
        checkpoints=folder / "checkpoint",
    )


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(run_config, tmp_path):
    start = protocol.pack_arrays(GLOBAL)
    whole = looped(run_config, tmp_path / "whole", 3).start(regions_grid(), start, 3, 10.0)
    # "Killed" after round 1: a new strategy resumes from round 1's checkpoint.
    looped(run_config, tmp_path / "cut", 3).start(regions_grid(), start, 1, 10.0)
    saved = load_checkpoint(tmp_path / "cut")
    assert saved.round == 1 and saved.federation_run == 7
    resumed = looped(run_config, tmp_path / "resumed", 3)
    resumed.federation_run = saved.federation_run
    resumed.recorder.data["rounds"] = saved.rounds
    final = resumed.start(regions_grid(), protocol.pack_arrays(saved.adapter), 3, 10.0, 2)
    np.testing.assert_array_equal(
        protocol.unpack_arrays(final)["w"], protocol.unpack_arrays(whole)["w"]
    )
    assert sorted(resumed.recorder.data["rounds"]) == ["0", "1", "2", "3"]
    assert load_checkpoint(tmp_path / "resumed").round == 3
