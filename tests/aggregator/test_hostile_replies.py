"""Issue 15, class 1: no reply can stop the aggregator.

Each hostile reply is built as an attacker would, from the documented wire format
(docs/envelope.md) with its own encoder, by an *enrolled* region (its signatures are
valid). It arrives beside honest replies from eu and us: the round completes, that
reply alone is rejected (in metrics.json and in the audit log, with the error's type),
and the published aggregate is exactly the honest regions' mean.
"""

# ruff: noqa: F811 - the fixtures imported from test_aggregator are parameters here

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from fedciuic.audit.log import WITNESS_EVENT, load_records, verify
from fedciuic.crypto.envelope import (
    SIGNED_LABEL_V2,
    InvalidEnvelope,
    open_envelope,
    parse_header,
    seal,
)
from fedciuic.crypto.keys import Keypair
from fedciuic.crypto.parties import REPLY_LABEL, update_payload
from fedciuic.crypto.xwing import CIPHERTEXT_SIZE
from fedciuic.wire import (
    ADAPTER_MODE,
    DEID_ENTITIES,
    ENVELOPE,
    KEY_ID,
    PRIVACY_UNIT,
    SIGNATURE,
    signed_fields,
)
from tests.aggregator.test_aggregator import (  # noqa: F401 - fixtures
    DP_METRICS,
    NO_DP,
    SCRUBBED,
    Raw,
    adapter_of,
    audited,
    declined,
    encoded,
    evaluated,
    from_region,
    policed,
    policy_hash,
    reply,
    sealed_envelope,
    sealed_round,
    signed,
    train_round,
    update_arrays,
)
from tests.conftest import written

INFO = {
    "status": "trained",
    "reason": "",
    "data-fingerprint": "fp",
    "jurisdiction": "",
    "policy-hash": "",
    PRIVACY_UNIT: "record",
    ADAPTER_MODE: "lora",
    DEID_ENTITIES: SCRUBBED,
}


def sealed_payload(policed, region: str, payload: bytes) -> Raw:
    """``payload`` sealed and signed by ``region``'s real keys: the envelope is authentic."""
    s, regions, folder = policed
    keypair = regions[region]
    envelope = seal(
        payload,
        sender=keypair,
        recipient=s.sealing.keys.keypair.bundle,
        run_id=7,
        server_round=1,
        region=region,
        policy_hash=bytes.fromhex(policy_hash(folder, region)),
    )
    return signed(sealed_envelope(region, envelope, keypair), keypair)


def payload_with(metrics: Any = None, info: Any = None, value: float = 1.0) -> bytes:
    """A plaintext update whose metrics and info are whatever JSON the attacker likes."""
    metadata = {
        "metrics": json.dumps(DP_METRICS if metrics is None else metrics),
        "info": json.dumps({"region": "cn", **INFO} if info is None else info),
    }
    return bytes(st_save({"update": np.frombuffer(encoded(value), np.uint8)}, metadata))


def metrics_with(**changes: Any) -> dict[str, Any]:
    return {k: v for k, v in {**DP_METRICS, **changes}.items() if v is not None}


def bad_offsets() -> bytes:
    """Safetensors whose header promises more bytes than the data holds."""
    good = payload_with()
    (size,) = struct.unpack_from("<Q", good)
    header = json.loads(good[8 : 8 + size])
    header["update"]["data_offsets"] = [0, 4096]
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + good[8 + size :]


def low_order_share(policed) -> Raw:
    """cn's authentic envelope whose X25519 share is the all-zero (low-order) point,
    re-signed by cn: the signature verifies, decapsulation cannot compute a secret."""
    regions = policed[1]
    content = sealed_payload(policed, "cn", payload_with())
    assert content.arrays is not None
    raw = bytearray(content.arrays[ENVELOPE].tobytes())
    header, header_end = parse_header(raw)
    kem_end = header_end + CIPHERTEXT_SIZE
    raw[kem_end - 32 : kem_end] = bytes(32)
    body_end = len(raw) - regions["cn"].bundle.signature_size()
    step = (1 << header.chunk_exponent) + 16  # a chunk of ciphertext and its GCM tag
    digests = b"".join(
        hashlib.sha256(raw[at : min(at + step, body_end)]).digest()
        for at in range(kem_end, body_end, step)
    )
    signed_hash = hashlib.sha256(bytes(raw[:kem_end]) + digests).digest()
    raw[body_end:] = regions["cn"].sign(SIGNED_LABEL_V2 + signed_hash)
    return signed(sealed_envelope("cn", raw, regions["cn"]), regions["cn"])


def list_metric(keypair: Keypair) -> Raw:
    content = declined("cn", "no")
    content.metrics = {"x": [1.0, 2.0]}
    return signed(content, keypair)


def clear_info(content: Raw, **changes: Any) -> Raw:
    content.info.update(changes)
    return content


#: name -> (build the hostile reply, what its rejection reason names)
HOSTILE: dict[str, tuple[Callable[[Any], Raw], str]] = {
    "num-examples NaN": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(**{"num-examples": "NaN"}))),
        "num-examples",
    ),
    "num-examples Infinity": (
        lambda p: sealed_payload(
            p, "cn", payload_with(metrics_with(**{"num-examples": float("inf")}))
        ),
        "num-examples",
    ),
    "num-examples a float": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(**{"num-examples": 60.0}))),
        "num-examples",
    ),
    "num-examples a boolean": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(**{"num-examples": True}))),
        "num-examples",
    ),
    "steps NaN": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(steps=float("nan")))),
        "steps",
    ),
    # Absent is legal (every step noise only); NaN is not.
    "train-loss NaN": (
        lambda p: sealed_payload(
            p, "cn", payload_with(metrics_with(**{"train-loss": float("nan")}))
        ),
        "train-loss",
    ),
    "an unknown metric": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(bonus=1))),
        "bonus",
    ),
    "metrics a JSON list": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics=[1, 2, 3])),
        "an object expected",
    ),
    "info a JSON list": (
        lambda p: sealed_payload(p, "cn", payload_with(info=["cn"])),
        "an object expected",
    ),
    "info with an extra key": (
        lambda p: sealed_payload(p, "cn", payload_with(info={"region": "cn", **INFO, "x": ""})),
        "keys",
    ),
    "info naming another region": (
        lambda p: sealed_payload(p, "cn", payload_with(info={"region": "eu", **INFO})),
        "names region 'eu'",
    ),
    "safetensors offsets past its data": (
        lambda p: sealed_payload(p, "cn", bad_offsets()),
        "not a fedciuic update",
    ),
    "payload not safetensors": (
        lambda p: sealed_payload(p, "cn", b"\xff" * 64),
        "not a fedciuic update",
    ),
    "epsilon NaN": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(epsilon=float("nan")))),
        "epsilon",
    ),
    "epsilon Infinity": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(epsilon=float("inf")))),
        "epsilon",
    ),
    "delta NaN": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(delta=float("nan")))),
        "delta",
    ),
    "clipping norm Infinity": (
        lambda p: sealed_payload(
            p, "cn", payload_with(metrics_with(**{"max-grad-norm": float("inf")}))
        ),
        "max-grad-norm",
    ),
    "privacy unit not a unit": (
        lambda p: sealed_payload(
            p, "cn", payload_with(info={"region": "cn", **INFO, PRIVACY_UNIT: "person"})
        ),
        "privacy-unit: 'person' is not one of record, user",
    ),
    "privacy figures without a unit": (
        lambda p: sealed_payload(
            p, "cn", payload_with(info={"region": "cn", **INFO, PRIVACY_UNIT: ""})
        ),
        "privacy-unit: '' is not one of record, user",
    ),
    "a unit without privacy figures": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(**NO_DP))),
        "privacy-unit: 'record' declared without DP figures",
    ),
    "half the privacy figures": (
        lambda p: sealed_payload(p, "cn", payload_with(metrics_with(**{"epsilon-budget": None}))),
        "epsilon-budget",
    ),
    "X25519 share a low-order point": (low_order_share, "InvalidEnvelope: invalid envelope"),
    "clear metrics a list value": (
        lambda p: list_metric(p[1]["cn"]),
        "malformed metrics: x: a number expected",
    ),
    "status unknown": (
        lambda p: signed(clear_info(declined("cn", "no"), status="bogus"), p[1]["cn"]),
        "status 'bogus'",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_reply_is_rejected_alone_and_the_aggregate_is_the_honest_mean(audited, case):
    s = audited[0]
    make, reason = HOSTILE[case]
    hostile = make(audited)
    result = train_round(
        s,
        1,
        [
            reply(11, from_region(audited, "eu", 1.0)),
            reply(12, hostile),
            reply(13, from_region(audited, "us", 3.0)),
        ],
    )
    # eu and us meet the policies' minimums
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)  # (1 + 3) / 2
    train = s.recorder.data.rounds[1].train
    assert train["eu"].status == train["us"].status == "trained"
    label = next(k for k in train if k not in ("eu", "us"))
    assert train[label].status == "rejected" and reason in train[label].reason, train
    records = load_records(s.audit.path)
    rejected = [r for r in records if r["event"] == "update_rejected"]
    assert len(rejected) == 1 and reason in rejected[0]["details"]["reason"]
    assert [r["event"] for r in records][-2:] == ["aggregate_published", "checkpoint"]
    assert verify(s.audit.path, s.sealing.keys.keypair.bundle).ok


def test_any_exception_inside_the_reply_boundary_rejects_only_that_reply(audited, monkeypatch):
    """A bug in fedciuic (here: the policy check raising a KeyError for cn) must not
    become a denial of service: the boundary names the type and the round goes on."""
    s = audited[0]
    real = s.policies.check_update

    def buggy(facts):
        if facts.region == "cn":
            raise KeyError("a bug")
        return real(facts)

    monkeypatch.setattr(type(s.policies), "check_update", lambda self, facts: buggy(facts))
    result = train_round(
        s,
        1,
        [
            reply(11, from_region(audited, "eu", 1.0)),
            reply(12, from_region(audited, "cn", 9.0)),
            reply(13, from_region(audited, "us", 3.0)),
        ],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)
    assert written(s.recorder.data.rounds[1].train["cn"]) == {
        "status": "rejected",
        "reason": "KeyError: 'a bug'",
        "global_version": 0,
        "staleness": 0,
    }


def test_a_failure_to_record_a_reply_rejects_it_instead_of_counting_it(audited, monkeypatch):
    from fedciuic.aggregator.journal import Journal

    s = audited[0]
    real = Journal._outcome

    def failing(journal, server_round, judged, entry):
        if judged.label == "cn":
            raise OSError("disk full")
        real(journal, server_round, judged, entry)

    monkeypatch.setattr(Journal, "_outcome", failing)
    result = train_round(
        s,
        1,
        [
            reply(11, from_region(audited, "eu", 1.0)),
            reply(12, from_region(audited, "cn", 9.0)),
            reply(13, from_region(audited, "us", 3.0)),
        ],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)  # cn not counted
    assert s.recorder.data.rounds[1].train["cn"].reason == "OSError: disk full"


# -- whose record is it ------------------------------------------------------------------


def test_garbage_labelled_eu_does_not_displace_eus_genuine_record(audited):
    s = audited[0]
    garbage = declined("eu", "garbage")
    garbage.info["status"] = "trained"  # unsigned, claims eu
    forged = from_region(audited, "cn", 50.0)  # cn's real reply, relabelled eu
    forged.info["region"] = "eu"
    result = train_round(
        s,
        1,
        [
            reply(21, garbage),  # first, so it would take eu's place if names were trusted
            reply(22, forged),
            reply(11, from_region(audited, "eu", 1.0)),
            reply(13, from_region(audited, "us", 3.0)),
        ],
    )
    np.testing.assert_allclose(adapter_of(result)["w"], 2.0)
    train = s.recorder.data.rounds[1].train
    assert train["eu"].status == "trained" and train["eu"].data_fingerprint == "fp"
    assert train["node-21"].status == "rejected"  # malformed: not even parsed
    assert train["node-22"].claimed_region == "eu"  # its signature no longer verifies
    assert not s.recorder.data.rounds[1].duplicates


def test_a_reply_signed_by_one_region_naming_another_is_recorded_under_its_signer(audited):
    s, regions, _ = audited
    content = declined("eu", "I am eu")
    signed(content, regions["cn"])  # cn's key signs a reply that says eu
    train_round(s, 1, [reply(12, content), reply(11, from_region(audited, "eu", 1.0))])
    train = s.recorder.data.rounds[1].train
    assert train["eu"].status == "trained"
    assert train["node-12"].status == "rejected"
    assert "signed by 'cn'" in train["node-12"].reason


def test_a_replayed_signed_reply_does_not_count_twice(audited):
    s, regions, _ = audited
    stats = signed(evaluated("eu", 2.0, 10), regions["eu"])
    again = Raw(dict(stats.info), dict(stats.metrics))
    us = signed(evaluated("us", 4.0, 10), regions["us"])
    result = s.evaluate(1, [reply(11, stats), reply(12, again), reply(13, us)])
    assert result.loss == pytest.approx(3.0)
    assert s.recorder.data.rounds[1].duplicates[0].status == "rejected"


def attacker_signed(content: Raw, keypair: Keypair) -> Raw:
    """Signed with the attacker's own encoder, which lets NaN and Infinity through."""
    info = content.info
    info[KEY_ID] = keypair.bundle.key_id.hex()
    fields = signed_fields(info, content.metrics)
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    info[SIGNATURE] = keypair.sign(REPLY_LABEL + struct.pack(">QI", 7, 1) + body)
    return content


@pytest.mark.parametrize(
    ("metrics", "field"),
    [
        # NaN and Infinity are not JSON: the signed bytes cannot be re-derived, so the
        # signature itself fails (the reply is never read as cn's)
        ({"eval-loss": float("nan"), "perplexity": 1.0, "num-examples": 10}, "InvalidEnvelope"),
        ({"eval-loss": 1.0, "perplexity": float("inf"), "num-examples": 10}, "InvalidEnvelope"),
        ({"eval-loss": -1.0, "perplexity": 1.0, "num-examples": 10}, "eval-loss"),
        ({"eval-loss": 1.0, "perplexity": 2.7, "num-examples": 0}, "num-examples"),
        ({"eval-loss": 1.0, "perplexity": 2.7}, "num-examples"),
    ],
)
def test_a_malformed_evaluation_is_rejected_alone(audited, metrics, field):
    s, regions, _ = audited
    bad = evaluated("cn", 1.0, 10)
    bad.metrics = metrics
    attacker_signed(bad, regions["cn"])
    eu = signed(evaluated("eu", 2.0, 10), regions["eu"])
    result = s.evaluate(1, [reply(11, eu), reply(12, bad)])
    assert result.loss == pytest.approx(2.0)
    evals = s.recorder.data.rounds[1].eval
    label = "node-12" if field == "InvalidEnvelope" else "cn"
    assert evals[label].status == "rejected" and field in evals[label].reason


def test_each_signed_reply_has_its_regions_audit_head_witnessed(audited):
    s, regions, _ = audited
    content = from_region(audited, "eu", 1.0)
    content.info.update({"audit-count": 3, "audit-head": "ab" * 32})
    signed(content, regions["eu"])
    train_round(s, 1, [reply(11, content)])
    witnessed = [r for r in load_records(s.audit.path) if r["event"] == WITNESS_EVENT]
    assert [w["details"] for w in witnessed] == [{"party": "eu", "count": 3, "head": "ab" * 32}]


def test_a_low_order_x25519_share_is_one_opaque_invalid_envelope(policed):
    s = policed[0]
    content = low_order_share(policed)
    assert content.arrays is not None
    raw = content.arrays[ENVELOPE].tobytes()
    with pytest.raises(InvalidEnvelope):
        open_envelope(raw, recipient=s.sealing.keys.keypair, senders=s.sealing.keys.regions)


def test_a_sealed_payload_from_update_payload_still_opens(policed):
    """The honest path through the same reader: what a region writes, the aggregator reads."""
    payload = update_payload(update_arrays(encoded(1.0)), DP_METRICS, {"region": "cn", **INFO})
    s = policed[0]
    content = sealed_payload(policed, "cn", payload)
    train_round(s, 1, [reply(12, content)])
    assert s.recorder.data.rounds[1].train["cn"].status == "trained"


@pytest.mark.parametrize(
    ("region", "policy"),
    [("cn", b"\x01" * 16), ("cn", b"\x01" * 33), ("CN", b""), ("c n", b""), ("", b"")],
)
def test_an_authentic_envelope_with_a_malformed_header_is_an_invalid_envelope(
    policed, region, policy
):
    """An opener checks the policy-hash length (0 or 32) and the region's charset, even
    in an envelope whose signature verifies."""
    s, regions, _ = policed
    envelope = seal(
        payload_with(),
        sender=regions["cn"],
        recipient=s.sealing.keys.keypair.bundle,
        run_id=7,
        server_round=1,
        region=region,
        policy_hash=policy,
    )
    with pytest.raises(InvalidEnvelope):
        open_envelope(envelope, recipient=s.sealing.keys.keypair, senders=s.sealing.keys.regions)
    with pytest.raises(InvalidEnvelope):  # and bytes after the signature
        open_envelope(
            bytes(
                seal(
                    payload_with(),
                    sender=regions["cn"],
                    recipient=s.sealing.keys.keypair.bundle,
                    run_id=7,
                    server_round=1,
                    region="cn",
                )
            )
            + b"\x00",
            recipient=s.sealing.keys.keypair,
            senders=s.sealing.keys.regions,
        )


@pytest.mark.parametrize("field", ["epsilon", "delta", "max_grad_norm"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_policy_check_refuses_a_non_finite_declared_figure(policed, field, value):
    """Behind the typed reply, the policy check itself fails closed on NaN and Inf."""
    from fedciuic.deid.entities import DIRECT
    from fedciuic.policy.rules import UpdateFacts

    s, _, folder = policed
    facts = UpdateFacts(
        region="cn",
        sender_jurisdiction="CN",
        policy_hash=policy_hash(folder, "cn"),
        epsilon=1.0,
        delta=1e-6,
        suite="xwing-aes256gcm",
        codec="dense",
        num_examples=60,
        max_grad_norm=1.0,
        secure_mode=True,
        deid_entities=(*DIRECT, "DICTIONARY"),
    )
    from dataclasses import replace

    decision = s.policies.check_update(replace(facts, **{field: value}))
    assert not decision.accepted and "is not a finite number" in "; ".join(decision.reasons)
