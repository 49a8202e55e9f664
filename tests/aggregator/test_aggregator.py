"""The aggregator's round without Flower: plain replies in, verdicts and aggregates out."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from fedciuic.aggregator.judge import Judged, Task
from fedciuic.aggregator.round import (
    AggregatorRound,
    EvalResult,
    Published,
    Withheld,
    run_end_witnessed,
)
from fedciuic.aggregator.run import held_policies
from fedciuic.audit.log import AuditLog, load_records, verify
from fedciuic.compression import get_codec
from fedciuic.compression.codecs import HEADER, UPDATE_FORMAT, UPDATE_MAGIC
from fedciuic.crypto.envelope import seal
from fedciuic.crypto.keys import Keypair, PublicBundle, load_keypair
from fedciuic.crypto.parties import (
    Misaddressed,
    NotSignedError,
    RegionKeys,
    TaskKind,
    aggregator_keys,
    generate_federation_keys,
    update_payload,
)
from fedciuic.deid.entities import DIRECT
from fedciuic.ops.outputs import summarize
from fedciuic.policy.binding import AggregatorPolicies
from fedciuic.policy.rules import PolicyError, load_policy
from fedciuic.record.metrics import PolicyHeld, RunSettings
from fedciuic.record.recorder import RunRecorder
from fedciuic.stages.sealing import SealedReplies
from fedciuic.wire import (
    ADAPTER_MODE,
    DEID_ENTITIES,
    ENVELOPE,
    PRIVACY_UNIT,
    Arrival,
    NoReply,
    Reply,
    Unread,
    failed,
    parse_reply,
    sign_info,
)
from tests.conftest import write_policy, written

GLOBAL = {"w": np.zeros(4, np.float32)}


@dataclass
class Raw:
    """A reply's clear fields as a region sends them (what ``protocol`` packs)."""

    info: dict[str, Any]
    metrics: dict[str, Any]
    arrays: dict[str, np.ndarray] | None = None


def reply(node_id: int, raw: Raw | Reply) -> Arrival:
    """A reply from ``node_id``, parsed inside the round's boundary."""
    if isinstance(raw, Reply):
        return raw
    return Unread(node_id, partial(parse_reply, node_id, raw.info, raw.metrics, raw.arrays))


def adapter_of(result: TrainResult) -> dict[str, np.ndarray]:
    assert isinstance(result.aggregate, Published), result.aggregate
    return result.aggregate.adapter


@dataclass(frozen=True)
class TrainResult:
    replies: list[Judged]
    aggregate: Published | Withheld


def train_round(a: AggregatorRound, server_round: int, arrivals: Iterable[Arrival]) -> TrainResult:
    """One synchronous round's replies judged and its aggregate published (or withheld),
    with the round's own steps as the production loop calls them (SyncLoop.one), minus
    its waiting."""
    into = a.collecting()
    task = Task(server_round, a.version)
    for item in arrivals:
        a.judge_train(server_round, item, task, into)
    return TrainResult(into.judged, a.publish(server_round, into))


def make_round(run_config, folder: Path, **kwargs: Any) -> AggregatorRound:
    recorder = RunRecorder(folder, {"run_id": 7, "regions": list(run_config.regions)})
    dense = run_config.updated(**{"codec": get_codec("dense")})  # updates below are dense
    a = AggregatorRound(dense, base_fingerprint="f" * 64, recorder=recorder, **kwargs)
    a.global_adapter = {k: v.copy() for k, v in GLOBAL.items()}
    return a


@pytest.fixture
def aggregator(run_config, tmp_path) -> AggregatorRound:
    return make_round(run_config, tmp_path / "run")


def encoded(value: float, n: int = 4) -> bytes:
    """A dense-codec update of ``n`` entries, all ``value`` (the run's codec is dense),
    written by hand: a hostile region's NaN is one fedciuic's encoder would refuse."""
    head = HEADER.pack(UPDATE_MAGIC, get_codec("dense").ident, UPDATE_FORMAT, n, 0)
    return head + np.full(n, value, np.float32).tobytes()


#: What a default run's region with its dictionary declares it scrubbed.
SCRUBBED = ",".join((*DIRECT, "DICTIONARY", "CONTEXT_NAME"))


def update_arrays(update: bytes) -> dict[str, np.ndarray]:
    return {"update": np.frombuffer(update, dtype=np.uint8)}


def trained(region: str, value: float, examples: int, n: int = 4) -> Raw:
    """An update in the clear (``seal = false``)."""
    update = encoded(value, n)
    return Raw(
        {
            "region": region,
            "status": "trained",
            "reason": "",
            "data-fingerprint": "fp-" + region,
            "jurisdiction": "",
            "policy-hash": "",
            PRIVACY_UNIT: "",
            ADAPTER_MODE: "lora",
            DEID_ENTITIES: "",
        },
        {"num-examples": examples, "steps": 5, "update-bytes": len(update)},
        update_arrays(update),
    )


def declined(region: str, reason: str) -> Raw:
    return Raw({"region": region, "status": "declined", "reason": reason}, {"num-examples": 0})


def evaluated(region: str, loss: float, examples: int) -> Raw:
    return Raw(
        {"region": region, "status": "evaluated", "reason": ""},
        {"num-examples": examples, "eval-loss": loss, "perplexity": float(np.exp(loss))},
    )


def signed(raw: Raw, keypair: Keypair, server_round: int = 1, run_id: int = 7) -> Raw:
    sign_info(raw.info, raw.metrics, keypair, run_id=run_id, server_round=server_round)
    return raw


def _with_loss(raw: Raw, loss: float = 1.0) -> Raw:
    """A reply with its training loss, which a region sends in a run whose evaluation is
    exact and whose policy lets it out (fedciuic/releases.py)."""
    raw.metrics["train-loss"] = loss
    return raw


@pytest.fixture
def exact_evaluations(run_config, tmp_path) -> AggregatorRound:
    """A round of a run whose evaluations are exact: its replies may carry train-loss."""
    return make_round(run_config.updated(eval_noise=0.0), tmp_path / "run")


def test_deltas_are_averaged_by_examples_and_applied(exact_evaluations):
    aggregator = exact_evaluations
    eu, cn = _with_loss(trained("eu", 1.0, 10)), _with_loss(trained("cn", 4.0, 30))
    result = train_round(aggregator, 1, [reply(11, eu), reply(12, cn)])
    np.testing.assert_allclose(adapter_of(result)["w"], 0.25 * 1 + 0.75 * 4)
    assert isinstance(result.aggregate, Published) and len(result.aggregate.regions) == 2
    assert result.aggregate.examples == 40 and result.aggregate.train_loss == pytest.approx(1.0)
    assert [j.status for j in result.replies] == ["trained", "trained"]


def test_an_update_whose_steps_were_all_noise_is_aggregated_without_a_loss(exact_evaluations):
    aggregator = exact_evaluations
    # Every DP-SGD step drew an empty Poisson batch: no train loss, the update counts.
    quiet = trained("cn", 4.0, 30)
    result = train_round(
        aggregator, 1, [reply(11, _with_loss(trained("eu", 1.0, 10))), reply(12, quiet)]
    )
    assert isinstance(result.aggregate, Published) and result.aggregate.regions == ["eu", "cn"]
    assert result.aggregate.train_loss == pytest.approx(1.0)  # over the regions with a loss
    alone = train_round(aggregator, 2, [reply(13, quiet)])
    assert isinstance(alone.aggregate, Published) and alone.aggregate.train_loss is None


def test_a_decline_is_recorded_and_the_others_are_aggregated(aggregator, tmp_path):
    result = train_round(
        aggregator,
        1,
        [reply(11, trained("eu", 2.0, 10)), reply(12, declined("cn", "budget spent"))],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["rounds"]["1"]["train"]["cn"] == {"status": "declined", "reason": "budget spent"}
    assert saved["rounds"]["1"]["train"]["eu"]["data_fingerprint"] == "fp-eu"


def test_failed_and_malformed_replies_are_rejected_alone(aggregator):
    bad_shape = trained("us", 1.0, 10, n=5)  # one entry too many for the adapter
    nan = trained("cn", float("nan"), 10)
    result = train_round(
        aggregator,
        1,
        [
            reply(11, trained("eu", 1.0, 10)),
            reply(12, nan),
            reply(13, bad_shape),
            failed(14, "", "process died"),
            reply(15, Raw({"x": 1}, {})),
            NoReply(16),
        ],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 1.0)
    train = aggregator.recorder.data.rounds[1].train
    assert train["cn"].status == "rejected" and "NaN" in train["cn"].reason
    assert train["us"].status == "rejected"
    assert "update has 5 entries, the adapter has 4" in train["us"].reason
    assert written(train["node-14"]) == {"status": "failed", "reason": "process died"}
    assert train["node-15"].status == "rejected"
    assert "MalformedReply" in train["node-15"].reason
    assert train["node-16"].status == "failed"
    assert train["node-16"].reason.startswith("no reply within round-timeout (")
    verdicts = {j.label: (j.status, j.reason.split(":")[0]) for j in result.replies}
    assert verdicts["node-15"] == ("rejected", "MalformedReply")


def test_round_where_every_region_declines_leaves_the_model_unchanged(aggregator):
    result = train_round(aggregator, 1, [reply(11, declined("eu", "no"))])
    assert isinstance(result.aggregate, Withheld)
    assert result.aggregate.reasons == ["no region's update was accepted"]
    np.testing.assert_array_equal(aggregator.global_adapter["w"], GLOBAL["w"])
    assert aggregator.recorder.data.rounds[1].aggregate.published is False


def test_evaluation_is_recorded_per_region_and_overall(aggregator):
    result = aggregator.evaluate(
        0, [reply(11, evaluated("eu", 2.0, 10)), reply(12, evaluated("cn", 4.0, 30))]
    )
    assert isinstance(result, EvalResult) and result.loss == pytest.approx(3.5)
    assert result.num_examples == 40
    evals = aggregator.recorder.data.rounds[0].eval
    assert evals["eu"].loss == 2.0 and evals["overall"].num_examples == 40


def test_an_evaluation_round_without_evaluations_has_no_loss(aggregator):
    result = aggregator.evaluate(0, [reply(11, declined("eu", "no"))])
    assert result.loss is None
    assert aggregator.recorder.data.rounds[0].eval["eu"].status == "declined"


# -- sealed updates --------------------------------------------------------------------


@pytest.fixture
def sealed_round(run_config, tmp_path) -> tuple[AggregatorRound, dict[str, Keypair]]:
    keys_dir = generate_federation_keys(tmp_path / "keys", ("eu", "cn", "us"))
    a = make_round(
        run_config,
        tmp_path / "run",
        sealing=SealedReplies(aggregator_keys(str(keys_dir), 2**20)),
        run_id=7,
    )
    regions = {r: load_keypair(keys_dir / f"{r}.key.json") for r in ("eu", "cn", "us")}
    return a, regions


def sealed_envelope(region: str, envelope: bytes | bytearray, keypair: Keypair) -> Raw:
    """A sealed update: the envelope, and in the clear only who sent it."""
    return Raw(
        {"region": region, "status": "sealed", "reason": "", "key-id": keypair.bundle.key_id.hex()},
        {},
        {ENVELOPE: np.frombuffer(bytes(envelope), dtype=np.uint8)},
    )


def sealed_reply_from(
    keypair: Keypair,
    aggregator: PublicBundle,
    value: float,
    server_round: int = 1,
    run_id: int = 7,
    metrics: dict[str, float] | None = None,
    policy_hash: str = "",
    suite: str = "xwing-aes256gcm",
    n: int = 4,
    signed_round: int | None = None,
    signed_run: int | None = None,
    unit: str | None = None,
    deid: str = SCRUBBED,
) -> Raw:
    """A sealed reply as a region sends it; ``signed_*``: the run and round its reply
    signature names, when they differ from its envelope's (a relayed old envelope);
    ``unit``: the privacy unit it declares (default: record with DP figures, else none);
    ``deid``: the entity types it declares it scrubbed."""
    region = keypair.bundle.party
    metrics = metrics or {"num-examples": 10, "steps": 1, "update-bytes": 16}
    if unit is None:
        unit = "record" if "epsilon" in metrics else ""
    payload = update_payload(
        update_arrays(encoded(value, n)),
        metrics,
        {
            "region": region,
            "status": "trained",
            "reason": "",
            "data-fingerprint": "fp",
            "jurisdiction": "",
            "policy-hash": policy_hash,
            PRIVACY_UNIT: unit,
            ADAPTER_MODE: "lora",
            DEID_ENTITIES: deid,
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
    return signed(
        sealed_envelope(region, envelope, keypair),
        keypair,
        run_id=run_id if signed_run is None else signed_run,
        server_round=server_round if signed_round is None else signed_round,
    )


def tampered(raw: Raw) -> Raw:
    assert raw.arrays is not None
    data = bytearray(raw.arrays[ENVELOPE].tobytes())
    data[-100] ^= 1
    raw.arrays[ENVELOPE] = np.frombuffer(bytes(data), np.uint8)
    return raw


def test_sealed_updates_are_opened_and_aggregated(sealed_round):
    a, regions = sealed_round
    agg = a.sealing.keys.keypair.bundle
    result = train_round(
        a,
        1,
        [
            reply(11, sealed_reply_from(regions["eu"], agg, 1.0)),
            reply(12, sealed_reply_from(regions["cn"], agg, 3.0)),
        ],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)


def test_sealed_path_rejects_replays_wrong_rounds_tampering_and_clear_updates(sealed_round):
    a, regions = sealed_round
    agg = a.sealing.keys.keypair.bundle
    good = sealed_reply_from(regions["eu"], agg, 1.0)
    result = train_round(
        a,
        1,
        [
            reply(11, good),
            reply(12, good),  # the same envelope again
            reply(13, sealed_reply_from(regions["cn"], agg, 9.0, server_round=2)),
            reply(14, tampered(sealed_reply_from(regions["us"], agg, 5.0))),
            reply(15, trained("us", 7.0, 10)),  # in the clear
        ],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 1.0)  # only eu's
    train = a.recorder.data.rounds[1].train
    assert train["eu"].status == "trained"
    # signed for round 2: its reply signature does not verify in round 1, so nothing
    # authenticates it as cn's and it is recorded under its node, its claim noted
    assert written(train["node-13"]) == {
        "status": "rejected",
        "reason": "InvalidEnvelope: invalid envelope",
        "claimed_region": "cn",
        "global_version": 0,  # what the round sent: every rejected update names it
        "staleness": 0,
    }
    # tampered envelope in a reply us signed: us's reply, rejected
    assert written(train["us"]) == {
        "status": "rejected",
        "reason": "InvalidEnvelope: invalid envelope",
        "global_version": 0,
        "staleness": 0,
    }
    # an unsigned update in the clear while sealing is on: nothing authenticates it
    assert train["node-15"].status == "rejected"
    assert train["node-15"].claimed_region == "us"
    duplicates = a.recorder.data.rounds[1].duplicates
    assert [written(d) for d in duplicates] == [
        {
            "region": "eu",
            "status": "rejected",
            "reason": "EnvelopeRejected: replay: a second envelope from eu in round 1",
            "global_version": 0,
            "staleness": 0,
        },
    ]


def test_the_global_adapter_signature_names_the_round_and_the_audit_head(sealed_round, tmp_path):
    a, regions = sealed_round
    plain = make_round(a.run, tmp_path / "plain").sign_instruction(1, TaskKind.TRAIN, GLOBAL, "eu")
    assert (plain.signature, plain.signer, plain.witness) == (b"", "", None)
    a.use(audit=AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", a.sealing.keys.keypair))
    a.audit.append("run_start", run_id=7)
    a.audit.checkpoint(run_id=7)
    task = a.sign_instruction(4, TaskKind.TRAIN, GLOBAL, "eu")
    assert task.signer == a.sealing.keys.keypair.bundle.key_id.hex() and task.signature
    assert task.witness == a.audit.last_checkpoint()
    assert (task.server_round, task.kind) == (4, TaskKind.TRAIN)
    assert task.run_config == a.run.canonical_json()
    keys = RegionKeys(regions["eu"], a.sealing.keys.keypair.bundle, "xwing-aes256gcm")
    check = partial(keys.check_global, task.signature, task.signer, 7)
    check(4, task.adapter, task.terms, task.witness)  # what it signed: round 4, this head
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(5, task.adapter, task.terms, task.witness)  # another round
    assert task.witness is not None
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(4, task.adapter, task.terms, (task.witness[0] + 1, task.witness[1]))  # another head
    with pytest.raises(NotSignedError, match="not signed by the aggregator"):
        check(4, task.adapter, replace(task.terms, recipient="cn"), task.witness)  # re-addressed
    cn = RegionKeys(regions["cn"], a.sealing.keys.keypair.bundle, "xwing-aes256gcm")
    with pytest.raises(Misaddressed, match="round 4 is addressed to 'eu', not to this region"):
        cn.check_global(task.signature, task.signer, 7, 4, task.adapter, task.terms, task.witness)


# -- jurisdiction policies ------------------------------------------------------------

DP_METRICS = {
    "num-examples": 60,
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
def policed(sealed_round, tmp_path) -> tuple[AggregatorRound, dict[str, Keypair], Path]:
    """The sealed round holding the shipped EU, CN and US policies (aggregator in EU)."""
    a, regions = sealed_round
    folder = tmp_path / "policies"
    for jurisdiction in ("EU", "CN", "US"):
        write_policy(folder / f"{jurisdiction.lower()}.yaml", jurisdiction)
    a.use(policies=AggregatorPolicies.load(a.run.updated(**{"policies_dir": str(folder)})))
    return a, regions, folder


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
    unit: Any = None,  # Any: callers spread metric dicts (**{"num-examples": 20}) here
    deid: Any = SCRUBBED,  # Any: as unit
    **changes,
) -> Raw:
    a, regions, folder = policed
    metrics = {k: v for k, v in {**DP_METRICS, **changes}.items() if v is not None}
    return sealed_reply_from(
        regions[region],
        a.sealing.keys.keypair.bundle,
        value,
        metrics=metrics,
        policy_hash=policy_hash(folder, region),
        n=n,
        server_round=server_round,
        run_id=run_id,
        signed_round=signed_round,
        signed_run=signed_run,
        unit=unit,
        deid=deid,
    )


def test_updates_within_their_senders_policies_are_aggregated(policed):
    a = policed[0]
    result = train_round(
        a,
        1,
        [reply(11, from_region(policed, "eu", 1.0)), reply(12, from_region(policed, "cn", 3.0))],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)
    decisions = a.recorder.data.rounds[1].decisions
    assert [d.outcome for d in decisions] == ["accept", "accept", "accept"]
    assert decisions[0].policy_hash == policy_hash(policed[2], "eu")
    assert decisions[2].subject == "aggregate"


def test_an_update_whose_declared_epsilon_exceeds_its_senders_policy_is_rejected(policed):
    a = policed[0]
    train_round(
        a,
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, epsilon=9.5)),
        ],
    )
    entry = a.recorder.data.rounds[1].train["cn"]
    assert entry.status == "rejected"
    assert "declared epsilon 9.5 > 8 (privacy.max_lifetime_epsilon)" in entry.reason


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"delta": 1e-3}, "delta 0.001 > 1e-05 (privacy.max_delta)"),
        ({"max-grad-norm": 3.0}, "clipping norm 3 > 1 (privacy.max_clipping_norm)"),
        (NO_DP, "no DP epsilon declared (privacy.dp_required)"),
    ],
)
def test_updates_breaking_their_senders_privacy_rules_are_rejected(policed, changes, rule):
    a = policed[0]
    train_round(a, 1, [reply(12, from_region(policed, "cn", 3.0, **changes))])
    entry = a.recorder.data.rounds[1].train["cn"]
    assert entry.status == "rejected" and rule in entry.reason


@pytest.mark.parametrize(
    ("declared", "rule"),
    [
        ("", "de-identification is off (deidentification.required)"),
        ("EMAIL_ADDRESS,PHONE_NUMBER", "does not scrub CN_RESIDENT_ID, US_SSN"),
        ("EMAIL", "malformed info: deid-entities: unknown entity type 'EMAIL'"),
        ("EMAIL_ADDRESS,EMAIL_ADDRESS", "malformed info: deid-entities: 'EMAIL_ADDRESS,EMAIL"),
        ("direct", "malformed info: deid-entities: 'direct' repeats or abbreviates"),
    ],
)
def test_an_update_not_scrubbed_as_its_senders_policy_requires_is_rejected(policed, declared, rule):
    """The sealed reply declares what its region scrubbed; the aggregator parses it and
    checks it against the sender's policy (the shipped CN and EU ones require it)."""
    a = policed[0]
    train_round(
        a,
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, deid=declared)),
        ],
    )
    train = a.recorder.data.rounds[1].train
    assert train["eu"].status == "trained"
    assert train["cn"].status == "rejected" and rule in train["cn"].reason, train["cn"].reason


def test_a_header_naming_another_policy_or_a_forbidden_suite_is_rejected(policed):
    a, regions, folder = policed
    agg = a.sealing.keys.keypair.bundle
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
    train_round(a, 1, [reply(11, wrong_policy), reply(12, fernet)])
    train = a.recorder.data.rounds[1].train
    assert "the aggregator holds" in train["eu"].reason
    assert "suite xwing-fernet not allowed (sealing.allowed_suites)" in train["cn"].reason


def test_an_unsealed_update_is_rejected_where_the_policy_requires_sealing(aggregator, tmp_path):
    folder = tmp_path / "policies"
    write_policy(folder / "eu.yaml", "EU")
    aggregator.use(
        policies=AggregatorPolicies.load(aggregator.run.updated(**{"policies_dir": str(folder)})),
    )
    clear = trained("eu", 1.0, 60)
    clear.info["jurisdiction"] = "EU"
    result = train_round(aggregator, 1, [reply(11, clear)])
    assert isinstance(result.aggregate, Withheld)
    entry = aggregator.recorder.data.rounds[1].train["eu"]
    assert entry.status == "rejected"
    assert "the update came unsealed (sealing.required)" in entry.reason


def test_a_refused_aggregate_leaves_the_global_model_unchanged(policed):
    a = policed[0]
    before = {k: v.copy() for k, v in a.global_adapter.items()}
    # One region accepted, the other rejected: the shipped policies need 2 regions.
    result = train_round(
        a,
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, epsilon=20.0)),
        ],
    )
    assert isinstance(result.aggregate, Withheld) and result.aggregate.regions == ["eu"]
    np.testing.assert_array_equal(a.global_adapter["w"], before["w"])
    aggregate = a.recorder.data.rounds[1].aggregate
    assert aggregate.published is False and aggregate.regions == ["eu"]
    assert "the strictest policy needs 2 (aggregation.min_regions)" in aggregate.reasons[0]
    assert "the strictest policy needs 100 (aggregation.min_examples)" in aggregate.reasons[1]
    assert result.aggregate.reasons == aggregate.reasons


def test_too_few_examples_withhold_the_aggregate(policed):
    a = policed[0]
    result = train_round(
        a,
        1,
        [
            reply(11, from_region(policed, "eu", 1.0, **{"num-examples": 20})),
            reply(12, from_region(policed, "cn", 3.0, **{"num-examples": 20})),
        ],
    )
    assert isinstance(result.aggregate, Withheld)
    reasons = a.recorder.data.rounds[1].aggregate.reasons
    assert reasons == [
        "40 examples in the aggregate, the strictest policy needs 100 (aggregation.min_examples)"
    ]


def test_a_region_whose_policy_the_aggregator_cannot_read_is_rejected(policed):
    a, _, folder = policed
    update = from_region(policed, "cn", 3.0)
    (folder / "cn.yaml").write_text("version: 1\njurisdiction: CN\n")
    a.use(policies=AggregatorPolicies.load(a.run.updated(**{"policies_dir": str(folder)})))
    train_round(a, 1, [reply(12, update)])
    entry = a.recorder.data.rounds[1].train["cn"]
    assert entry.status == "rejected"
    assert "no readable policy for CN" in entry.reason and "cn.yaml:1" in entry.reason


def test_the_aggregator_refuses_to_start_without_policies_or_in_the_wrong_place(
    run_config, tmp_path
):
    recorder = RunRecorder(tmp_path / "run", {"run_id": 7})
    keys = aggregator_keys(str(generate_federation_keys(tmp_path / "keys", ("eu",), "US")), 2**20)
    with pytest.raises(PolicyError, match="run config:policies-dir: empty"):
        held_policies(run_config.updated(**{"policies_dir": ""}), None, recorder)
    with pytest.raises(PolicyError, match="aggregator-jurisdiction: EU, but the aggregator's key"):
        held_policies(run_config.updated(**{"policies_dir": str(tmp_path)}), keys, recorder)
    assert held_policies(run_config.updated(**{"enforce_policies": False}), keys, recorder) is None
    assert recorder.data.run.policies is None


def test_the_summary_names_policies_withheld_aggregates_and_refusals(policed):
    a = policed[0]
    run = a.recorder.data.run
    run.config = RunSettings(aggregator_jurisdiction="EU")
    run.policies = {"EU": PolicyHeld(file="eu.yaml", hash="ab" * 32)}
    run.regions = ["eu", "cn"]
    train_round(
        a,
        1,
        [
            reply(11, from_region(policed, "eu", 1.0)),
            reply(12, from_region(policed, "cn", 3.0, epsilon=20.0)),
        ],
    )
    text = summarize(a.recorder.data)
    assert "policies (aggregator in EU): EU abababababab" in text
    assert "round 1: aggregate withheld, global adapter unchanged: 1 region(s)" in text
    assert "round 1: cn rejected: declared epsilon 20 > 8" in text


def test_the_aggregator_logs_each_arrival_decision_and_aggregate(policed, tmp_path):
    a = policed[0]
    a.use(audit=AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", a.sealing.keys.keypair))
    good, bad = from_region(policed, "eu", 1.0), from_region(policed, "cn", 3.0, epsilon=20.0)
    train_round(a, 1, [reply(11, good), reply(12, bad)])
    records = load_records(a.audit.path)
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
    assert good.arrays is not None
    envelope = good.arrays[ENVELOPE].tobytes()
    assert records[0]["details"]["digest"] == hashlib.sha256(envelope).hexdigest()
    assert "declared epsilon 20 > 8" in records[5]["details"]["reason"]
    assert verify(a.audit.path, a.sealing.keys.keypair.bundle).ok


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
    a = policed[0]
    a.use(audit=AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", a.sealing.keys.keypair))
    return policed


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_update_is_rejected_and_audited_and_the_round_goes_on(audited, case):
    a = audited[0]
    make, reason = HOSTILE[case]
    result = train_round(
        a,
        1,
        [
            reply(11, from_region(audited, "eu", 1.0)),
            reply(12, make(audited)),
            reply(13, from_region(audited, "us", 3.0)),
        ],
    )
    # eu and us meet the policies' minimums
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)
    assert a.recorder.data.rounds[1].train["cn"].status == "rejected"
    rejected = [
        r
        for r in load_records(a.audit.path)
        if r["event"] == "update_rejected" and r["details"]["region"] == "cn"
    ]
    assert len(rejected) == 1 and reason in rejected[0]["details"]["reason"], rejected
    assert verify(a.audit.path, a.sealing.keys.keypair.bundle).ok


@pytest.mark.parametrize("case", ["NaN values", "scaled by 100", "tampered ciphertext"])
def test_below_the_minimums_the_round_ends_explicitly_and_the_model_is_untouched(audited, case):
    a = audited[0]
    before = a.global_adapter["w"].copy()
    make, _ = HOSTILE[case]
    result = train_round(
        a, 1, [reply(11, from_region(audited, "eu", 1.0)), reply(12, make(audited))]
    )
    assert isinstance(result.aggregate, Withheld)
    np.testing.assert_array_equal(a.global_adapter["w"], before)
    events = [r["event"] for r in load_records(a.audit.path)]
    assert "update_rejected" in events and events[-2:] == ["aggregate_withheld", "checkpoint"]


def test_a_clipped_update_is_recorded_with_its_norm(policed):
    a = policed[0]
    a.use(run=a.run.updated(**{"update_norm_action": "clip", "max_update_norm": 2.0}))
    result = train_round(
        a,
        1,
        [reply(11, from_region(policed, "eu", 1.0)), reply(12, from_region(policed, "cn", 100.0))],
    )
    cn = a.recorder.data.rounds[1].train["cn"]
    assert cn.clipped is True and cn.norm == pytest.approx(200.0)
    # eu's delta (norm 2) is within the bound; cn's is scaled to norm 2: all ones.
    np.testing.assert_allclose(adapter_of(result)["w"], 1.0, rtol=1e-5)


# -- the end of a round and of the run ----------------------------------------------------


def test_each_training_round_ends_with_a_checkpoint_to_resume_from(run_config, tmp_path):
    from fedciuic.aggregator.checkpoint import load_checkpoint

    a = make_round(run_config, tmp_path / "run", run_id=7, checkpoints=tmp_path / "run" / "cp")
    a.evaluate(0, [reply(11, evaluated("eu", 1.0, 10))])
    a.end(0)
    assert not (tmp_path / "run" / "cp").exists()  # the initial evaluation saves none
    train_round(a, 1, [reply(11, trained("eu", 1.0, 10))])
    a.end(1)
    saved = load_checkpoint(tmp_path / "run" / "cp")
    assert saved.round == 1 and saved.federation_run == 7
    np.testing.assert_allclose(saved.adapter["w"], 1.0)


def test_the_checkpoint_carries_the_server_optimizer_and_the_schedule(run_config, tmp_path):
    from fedciuic.aggregator.checkpoint import load_checkpoint

    adam = run_config.updated(**{"server_optimizer": "fedavgm", "keep_checkpoints": 2})
    a = make_round(adam, tmp_path / "run", run_id=7, checkpoints=tmp_path / "run" / "cp")
    for server_round in (1, 2, 3):
        train_round(a, server_round, [reply(11, trained("eu", 1.0, 10))])
        a.heard(server_round, [11])
        a.end(server_round)
    saved = load_checkpoint(tmp_path / "run" / "cp")
    assert saved.extra["version"] == 3  # three aggregates published
    assert saved.extra["availability"]["missed"] == {"eu": 0, "cn": 3, "us": 3}
    assert saved.extra["availability"]["unavailable"] == ["cn", "us"]  # max-missed-rounds 3
    again = make_round(adam, tmp_path / "again")
    again.restore_schedule(saved.extra)
    assert again.version == 3 and again.availability.unavailable == {"cn", "us"}
    assert saved.optimizer is not None and saved.optimizer.name == "fedavgm"
    assert saved.optimizer.steps == 3
    np.testing.assert_allclose(saved.optimizer.arrays["m"], 1 + 0.9 + 0.81, rtol=1e-6)
    np.testing.assert_allclose(saved.adapter["w"], 1 + 1.9 + 2.71, rtol=1e-6)
    assert sorted(p.name for p in (tmp_path / "run" / "cp").glob("round-*")) == [
        "round-0002",
        "round-0003",
    ]


@pytest.mark.parametrize(("steps", "reason"), [(0, "got 0"), (31, "over local-steps 30")])
def test_an_implausible_step_count_is_rejected_alone(aggregator, steps, reason):
    bad = trained("cn", 9.0, 10)
    bad.metrics["steps"] = steps
    result = train_round(aggregator, 1, [reply(11, trained("eu", 1.0, 10)), reply(12, bad)])
    cn = aggregator.recorder.data.rounds[1].train["cn"]
    assert cn.status == "rejected" and "ImplausibleUpdate" in cn.reason and reason in cn.reason
    np.testing.assert_allclose(adapter_of(result)["w"], 1.0)


def test_an_update_trained_in_another_adapter_mode_is_refused_in_one_line(aggregator):
    other = trained("cn", 9.0, 10)  # the same size, so only the declared mode tells
    other.info[ADAPTER_MODE] = "lora-sb"
    result = train_round(aggregator, 1, [reply(11, trained("eu", 1.0, 10)), reply(12, other)])
    cn = aggregator.recorder.data.rounds[1].train["cn"]
    assert cn.status == "rejected" and "\n" not in cn.reason
    assert "adapter-mode 'lora-sb', this run's is 'lora'" in cn.reason
    np.testing.assert_allclose(adapter_of(result)["w"], 1.0)


def test_regions_that_took_different_step_counts_are_normalised(aggregator):
    slow, fast = trained("eu", 1.0, 10), trained("cn", 6.0, 10)
    slow.metrics["steps"], fast.metrics["steps"] = 2, 6  # 0.5 and 1 per step
    result = train_round(aggregator, 1, [reply(11, slow), reply(12, fast)])
    # tau_eff = 4; 4 * (0.5 * 0.5 + 0.5 * 1) = 3 (FedAvg: 3.5)
    np.testing.assert_allclose(adapter_of(result)["w"], 3.0, rtol=1e-6)


def test_the_run_end_is_witnessed_by_the_regions_that_answer(sealed_round, tmp_path):
    a, regions = sealed_round
    assert a.sign_run_end(["eu"]) == {}  # no audit log: nothing to witness
    a.use(audit=AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", a.sealing.keys.keypair))
    a.audit.append("run_end", run_id=7, status="completed")
    a.audit.checkpoint(run_id=7)
    notices = a.sign_run_end(["eu", "cn"])
    assert {n.recipient for n in notices.values()} == set(notices) == {"eu", "cn"}
    assert notices["eu"].nonce != notices["cn"].nonce
    for notice in notices.values():
        assert notice.witness == a.audit.last_checkpoint() and notice.signature
    keys = RegionKeys(regions["eu"], a.sealing.keys.keypair.bundle, "xwing-aes256gcm")
    for region, notice in notices.items():
        check = partial(
            keys.check_run_end, notice.signature, notice.signer, 7, notice.terms, notice.witness
        )
        if region == "eu":
            check(notice.receipts_digest)
        else:  # signed, for cn: eu refuses it
            with pytest.raises(Misaddressed, match="is addressed to 'cn', not to this region"):
                check(notice.receipts_digest)
    head = "cd" * 32
    eu = Raw({"region": "eu", "status": "witnessed", "reason": ""}, {})
    eu.info.update({"audit-count": 5, "audit-head": head})
    signed(eu, regions["eu"], server_round=0)
    unsigned = Raw({"region": "cn", "status": "witnessed", "reason": ""}, {})
    answers = cast(list[Unread], [reply(11, eu), reply(12, unsigned)])
    assert run_end_witnessed(a, answers) == ["eu"]
    records = load_records(a.audit.path)
    assert [r["event"] for r in records][-3:] == ["witness", "run_end_witnessed", "checkpoint"]
    assert records[-3]["details"] == {"party": "eu", "count": 5, "head": head}
    assert records[-2]["details"]["regions"] == ["eu"]


# -- the privacy unit ------------------------------------------------------------------


@pytest.fixture
def eu_requires_user(audited):
    """The audited round, with the EU policy requiring user-level DP (as shipped)."""
    a, _, folder = audited
    write_policy(folder / "eu.yaml", "EU", privacy__unit="user")
    a.use(policies=AggregatorPolicies.load(a.run.updated(**{"policies_dir": str(folder)})))
    return audited


def test_an_update_declaring_record_from_a_region_whose_policy_requires_user_is_rejected(
    eu_requires_user,
):
    a = eu_requires_user[0]
    train_round(
        a,
        1,
        [
            reply(11, from_region(eu_requires_user, "eu", 1.0, unit="record")),
            reply(12, from_region(eu_requires_user, "cn", 3.0)),
        ],
    )
    entry = a.recorder.data.rounds[1].train["eu"]
    assert entry.status == "rejected"
    assert "declared privacy unit record, policy requires user (privacy.unit)" in entry.reason


def test_metrics_and_the_audit_log_name_each_updates_privacy_unit(eu_requires_user):
    a = eu_requires_user[0]
    result = train_round(
        a,
        1,
        [
            reply(11, from_region(eu_requires_user, "eu", 1.0, unit="user")),
            reply(12, from_region(eu_requires_user, "cn", 3.0)),  # CN accepts record-level
        ],
    )
    assert isinstance(result.aggregate, Published)
    train = a.recorder.data.rounds[1].train
    assert (train["eu"].unit, train["cn"].unit) == ("user", "record")
    assert written(train["eu"])["unit"] == "user"
    accepted = {
        r["details"]["region"]: (r["details"]["unit"], r["details"]["data_fingerprint"])
        for r in load_records(a.audit.path)
        if r["event"] == "update_accepted"
    }
    # Unit and dataset: what a region's ledger rebuild reads this epsilon as a floor of.
    assert accepted == {"eu": ("user", "fp"), "cn": ("record", "fp")}
