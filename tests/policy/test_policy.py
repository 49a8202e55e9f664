"""Jurisdiction policies: the shipped files, malformed files, and every rule at both ends."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fedciuic.config import RunConfig
from fedciuic.deid.entities import DIRECT
from fedciuic.policy.rules import (
    DP_ONLY,
    Agent,
    LoadedPolicy,
    PolicyError,
    RunTerms,
    UpdateFacts,
    check_aggregate,
    check_run,
    check_update,
    explain,
    load_policies,
    load_policy,
)
from fedciuic.releases import unavoidable
from tests.conftest import EXACT_RELEASES, ROOT, unit_config, write_policy

POLICIES = ROOT / "policies"
SHIPPED = ["eu-gdpr.yaml", "cn-pipl.yaml", "us-ccpa.yaml", "sg-pdpa.yaml", "in-dpdp.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_policy_validates(name):
    loaded = load_policy(POLICIES / name)
    assert len(loaded.hash) == 64 and loaded.policy.laws


def test_policies_by_jurisdiction():
    found = load_policies(POLICIES)
    assert sorted(found.by_jurisdiction) == ["CN", "EU", "IN", "SG", "US"]
    assert found.problems == ()


def test_an_unreadable_policy_leaves_its_jurisdiction_without_one(tmp_path):
    (tmp_path / "eu.yaml").write_text((POLICIES / "eu-gdpr.yaml").read_text())
    (tmp_path / "cn.yaml").write_text("version: 1\njurisdiction: CN\n")
    found = load_policies(tmp_path)
    assert sorted(found.by_jurisdiction) == ["EU"]
    with pytest.raises(PolicyError, match=r"no valid policy for jurisdiction CN.*cn\.yaml:1"):
        found.require("CN")


def test_two_policies_for_one_jurisdiction_trust_neither(tmp_path):
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text((POLICIES / "eu-gdpr.yaml").read_text())
    found = load_policies(tmp_path)
    assert found.get("EU") is None and "a second policy for EU" in found.problems[0]


def test_hash_ignores_comments_and_layout(tmp_path):
    text = (POLICIES / "eu-gdpr.yaml").read_text()
    stripped = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    (tmp_path / "p.yaml").write_text(stripped + "\n\n")
    assert load_policy(tmp_path / "p.yaml").hash == load_policy(POLICIES / "eu-gdpr.yaml").hash


def edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


def test_a_policy_edited_between_two_checks_is_read_as_edited(tmp_path):
    # Each check reads the file again; only a parse of the same text is reused.
    path = tmp_path / "p.yaml"
    path.write_text(EU)
    first = load_policy(path)
    path.write_text(edit(EU, "max_epsilon_per_run: 8.0", "max_epsilon_per_run: 2.0"))
    second = load_policy(path)
    assert first.policy.privacy.max_epsilon_per_run == 8.0
    assert second.policy.privacy.max_epsilon_per_run == 2.0
    assert second.hash != first.hash
    path.write_text(edit(EU, "min_regions: 2", "min_regions: two"))
    with pytest.raises(PolicyError, match=r"p\.yaml:\d+: "):
        load_policy(path)
    path.write_text(EU)
    assert load_policy(path).hash == first.hash


EU = (POLICIES / "eu-gdpr.yaml").read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (edit(EU, "dp_required: true", "dp_required: [true"), r"p\.yaml:\d+: YAML syntax error"),
        (
            edit(EU, "min_regions: 2", "min_regions: two"),
            r"p\.yaml:\d+: aggregation\.min_regions: Input should be a valid integer",
        ),
        (
            edit(EU, "min_regions: 2", "min_regions: 2\n  max_regions: 9"),
            r"p\.yaml:\d+: aggregation\.max_regions: Extra inputs are not permitted",
        ),
        (edit(EU, "  max_delta: 1.0e-5\n", ""), r"p\.yaml:\d+: privacy\.max_delta: Field required"),
        (
            edit(EU, "jurisdiction: EU", "jurisdiction: XX"),
            r"p\.yaml:4: jurisdiction: Value error, unknown jurisdiction \['XX'\]",
        ),
        ("", r"p\.yaml:1: the policy file is empty"),
        ("- a\n- list\n", r"p\.yaml:1: a policy is a mapping"),
    ],
    ids=[
        "syntax",
        "wrong-type",
        "unknown-field",
        "missing-field",
        "unknown-jurisdiction",
        "empty",
        "not-a-mapping",
    ],
)
def test_malformed_policy_names_file_line_and_field(tmp_path, content, message):
    (tmp_path / "p.yaml").write_text(content)
    with pytest.raises(PolicyError, match=message):
        load_policy(tmp_path / "p.yaml")


def test_missing_policy_file_says_what_to_do(tmp_path):
    with pytest.raises(PolicyError, match="no policy file here; copy one from policies/"):
        load_policy(tmp_path / "eu.yaml")


@pytest.fixture(scope="module")
def eu() -> LoadedPolicy:
    return load_policy(POLICIES / "eu-gdpr.yaml")


@pytest.fixture(scope="module")
def cn() -> LoadedPolicy:
    return load_policy(POLICIES / "cn-pipl.yaml")


#: What a region with a dictionary scrubs of the default deid-entities (direct, names).
SCRUBBED = (*DIRECT, "DICTIONARY", "CONTEXT_NAME")
#: The one line a region without a dictionary or NER model is declined with.
NO_NAMES = (
    "names are required (deidentification.entities: names) but this region has neither "
    "a name dictionary nor a NER model: set deid-dictionary or deid-ner-model in its "
    "agent config"
)

GOOD = RunTerms(
    aggregator_jurisdiction="EU",
    relay_jurisdiction="EU",
    dp=True,
    target_epsilon=8.0,
    epsilon_budget=8.0,
    delta=1e-5,
    max_grad_norm=1.0,
    secure_mode=True,
    seal=True,
    seal_suite="xwing-aes256gcm",
    codec="topk-int8",
    privacy_unit="user",  # the shipped EU policy requires user-level DP
    deid_entities=SCRUBBED,  # the shipped EU and CN policies require de-identification
)

RUN_RULES = [
    ({}, None),
    ({"deid_entities": ()}, "de-identification is off (deidentification.required)"),
    (
        {"deid_entities": ("EMAIL_ADDRESS", "PHONE_NUMBER", "DICTIONARY")},
        "does not scrub CN_RESIDENT_ID, US_SSN",
    ),
    ({"deid_entities": (*DIRECT, "CONTEXT_NAME")}, NO_NAMES),
    ({"deid_entities": (*DIRECT, "PERSON")}, None),  # a NER model meets names
    ({"deid_entities": (*DIRECT, "DICTIONARY")}, None),
    (
        {"deid_entities": DIRECT},
        "names are required (deidentification.entities: names) but this region does not "
        "scrub them: list names in the run's deid-entities, and set deid-dictionary or "
        "deid-ner-model in its agent config",
    ),
    ({"aggregator_jurisdiction": "CN"}, "transfers.aggregator_jurisdictions"),
    ({"aggregator_jurisdiction": "US"}, None),
    ({"relay_jurisdiction": "SG"}, None),  # EU allows ciphertext via a third-country relay
    ({"dp": False}, "privacy.dp_required"),
    ({"target_epsilon": 9.0}, "privacy.max_epsilon_per_run"),
    ({"epsilon_budget": 20.0}, "privacy.max_lifetime_epsilon"),
    ({"delta": 1e-4}, "privacy.max_delta"),
    ({"max_grad_norm": 2.0}, "privacy.max_clipping_norm"),
    ({"seal": False}, "sealing.required"),
    ({"seal_suite": "xwing-fernet"}, "sealing.allowed_suites"),
    ({"codec": "zstd"}, "compression.allowed_codecs"),
    ({"privacy_unit": "record"}, "privacy unit record, policy requires user (privacy.unit)"),
]


@pytest.mark.parametrize(("change", "rule"), RUN_RULES)
def test_region_side_rules(eu, change, rule):
    decision = check_run("eu", eu, replace(GOOD, **change))
    if rule is None:
        assert decision.accepted and decision.reasons == ()
    else:
        assert decision.outcome == "decline"
        assert len(decision.reasons) == 1 and rule in decision.reasons[0]
    assert decision.policy_hash == eu.hash


def test_cn_refuses_a_foreign_aggregator_and_relay_with_every_reason(cn):
    terms = replace(GOOD, aggregator_jurisdiction="US", relay_jurisdiction="SG", delta=1e-4)
    decision = check_run("cn", cn, terms)
    assert decision.outcome == "decline"
    text = decision.explain()
    for rule in (
        "transfers.aggregator_jurisdictions",
        "transfers.relay_in_third_country",
        "privacy.max_delta",
    ):
        assert rule in text
    assert len(decision.reasons) == 3


def test_secure_rng_required(eu):
    strict = LoadedPolicy(
        eu.policy.model_copy(
            update={"privacy": eu.policy.privacy.model_copy(update={"secure_rng_required": True})}
        ),
        eu.path,
    )
    insecure = replace(GOOD, secure_mode=False)
    assert "privacy.secure_rng_required" in check_run("eu", strict, insecure).reasons[0]
    assert check_run("eu", strict, replace(GOOD, secure_mode=True)).accepted


FACTS = UpdateFacts(
    region="eu",
    sender_jurisdiction="EU",
    policy_hash="",
    epsilon=7.9,
    delta=1e-5,
    suite="xwing-aes256gcm",
    codec="topk-int8",
    num_examples=500,
    secure_mode=True,
    unit="user",
    deid_entities=SCRUBBED,
)

UPDATE_RULES = [
    ({}, None),
    ({"deid_entities": ()}, "de-identification is off (deidentification.required)"),
    (
        {"deid_entities": SCRUBBED[1:]},
        "does not scrub EMAIL_ADDRESS (deidentification.entities)",
    ),
    ({"deid_entities": (*DIRECT, "CONTEXT_NAME")}, NO_NAMES),  # refused at this end too
    ({"deid_entities": (*DIRECT, "PERSON", "CONTEXT_NAME")}, None),
    ({"epsilon": 17.0}, "declared epsilon 17 > 16"),
    ({"epsilon": None}, "privacy.dp_required"),
    ({"delta": 1e-3}, "privacy.max_delta"),
    ({"suite": "xwing-fernet"}, "sealing.allowed_suites"),
    ({"codec": "zstd"}, "compression.allowed_codecs"),
    ({"sender_jurisdiction": "US"}, "the policy is EU's"),
    ({"policy_hash": "0" * 64}, "the aggregator holds"),
    ({"max_grad_norm": 4.0}, "privacy.max_clipping_norm"),
    ({"max_grad_norm": 1.0}, None),
    ({"suite": "none"}, "the update came unsealed (sealing.required)"),
    ({"unit": "record"}, "declared privacy unit record, policy requires user (privacy.unit)"),
    ({"unit": None}, "declared privacy unit record, policy requires user (privacy.unit)"),
]


@pytest.mark.parametrize(("change", "rule"), UPDATE_RULES)
def test_aggregator_side_rules(eu, change, rule):
    facts = replace(FACTS, **{"policy_hash": eu.hash, **change})
    decision = check_update(eu, facts, GOOD)
    if rule is None:
        assert decision.accepted
    else:
        assert decision.outcome == "reject" and len(decision.reasons) == 1
        assert rule in decision.reasons[0]


def test_aggregator_outside_the_senders_allowed_list_rejects(cn):
    facts = replace(FACTS, region="cn", sender_jurisdiction="CN", policy_hash=cn.hash)
    assert check_update(cn, facts, GOOD).accepted  # EU, under the standard contract
    decision = check_update(cn, facts, replace(GOOD, aggregator_jurisdiction="US"))
    assert decision.outcome == "reject" and "CN's policy allows CN, EU" in decision.reasons[0]
    relayed = check_update(cn, facts, replace(GOOD, relay_jurisdiction="SG"))
    assert "transfers.relay_in_third_country" in relayed.reasons[0]


def test_a_record_level_policy_accepts_either_unit_and_user_implies_record(cn, eu):
    """``privacy.unit`` is a least unit: record (or absent) accepts user-level DP too."""
    assert cn.policy.privacy.unit == "record" and eu.policy.privacy.unit == "user"
    for unit in ("record", "user"):
        assert check_run("cn", cn, replace(GOOD, privacy_unit=unit)).accepted
        facts = replace(FACTS, region="cn", sender_jurisdiction="CN", policy_hash=cn.hash)
        assert check_update(cn, replace(facts, unit=unit), GOOD).accepted
    # Without DP there is no unit to check: dp_required says what is wrong.
    off = check_run("eu", eu, replace(GOOD, dp=False, privacy_unit="record"))
    assert off.reasons == ("DP is off (privacy.dp_required)",)


def test_privacy_unit_is_optional_absent_is_record_and_keeps_the_hash(tmp_path, cn):
    explicit = tmp_path / "cn.yaml"
    explicit.write_text(
        edit(
            (POLICIES / "cn-pipl.yaml").read_text(),
            "  secure_rng_required: true\n",
            "  secure_rng_required: true\n  unit: record\n",
        )
    )
    assert load_policy(explicit).hash == cn.hash  # one meaning, one hash
    user = tmp_path / "user.yaml"
    user.write_text(edit(explicit.read_text(), "unit: record", "unit: user"))
    assert load_policy(user).policy.privacy.unit == "user" and load_policy(user).hash != cn.hash
    bad = tmp_path / "bad.yaml"
    bad.write_text(edit(explicit.read_text(), "unit: record", "unit: person"))
    with pytest.raises(PolicyError, match=r"bad.yaml:\d+: privacy.unit: Input should be"):
        load_policy(bad)


def test_explain_names_the_privacy_unit(eu, cn):
    assert "each guarantee must cover a whole user" in explain(eu)
    assert "a guarantee per record suffices" in explain(cn)


def test_explain_says_what_may_leave_besides_dp_releases(eu, tmp_path):
    assert "Nothing of the region's data leaves outside DP (privacy.releases: dp_only)" in (
        explain(eu)
    )
    anything = explain(_dp_only(tmp_path / "any.yaml", "any"))
    assert "Figures of the region's data (its example count, its losses) may leave" in anything


def test_explain_says_names_need_a_dictionary_or_a_ner_model(cn):
    assert (
        "SE_PERSONNUMMER; and names, found by its own name dictionary or NER model "
        "(deid-dictionary or deid-ner-model in its agent config)."
    ) in explain(cn)


def test_no_readable_policy_rejects_fail_closed():
    decision = check_update(None, FACTS, GOOD, "eu.yaml:3: privacy: Field required")
    assert decision.outcome == "reject" and "no readable policy for EU" in decision.reasons[0]
    assert "eu.yaml:3: privacy: Field required" in decision.reasons[0]


def test_aggregate_needs_the_strictest_minimum(eu, cn, tmp_path):
    strict = tmp_path / "strict.yaml"
    strict.write_text(edit(EU, "min_regions: 2", "min_regions: 3"))
    three = load_policy(strict)
    assert check_aggregate({"eu": eu, "cn": cn}, {"eu": 60, "cn": 60}).accepted
    refused = check_aggregate({"eu": three, "cn": cn}, {"eu": 60, "cn": 60})
    assert refused.outcome == "reject" and "needs 3 (aggregation.min_regions)" in refused.reasons[0]
    few = check_aggregate({"eu": eu, "cn": cn}, {"eu": 30, "cn": 30})
    assert few.outcome == "reject" and "needs 100 (aggregation.min_examples)" in few.reasons[0]
    assert check_aggregate({}, {}).outcome == "reject"


def test_shipped_files_are_the_ones_documented():
    assert sorted(p.name for p in Path(POLICIES).glob("*.yaml")) == sorted(SHIPPED)
    assert sorted(p.name for p in (POLICIES / "health").glob("*.yaml")) == sorted(HEALTH)
    readme = (POLICIES / "README.md").read_text()
    for name in [*SHIPPED, *(f"health/{h}" for h in HEALTH)]:
        assert f"`{name}`" in readme


HEALTH = ["us-hipaa.yaml", "eu-ehds.yaml"]


def test_the_health_policies_are_a_folder_of_their_own_that_requires_user_level_dp():
    """policies/health/ is not read with policies/ (no second EU or US policy there),
    and read on its own it is one policy per jurisdiction, each stricter than the
    general one and requiring user-level DP."""
    general = load_policies(POLICIES)
    assert general.problems == () and general.require("EU").path == POLICIES / "eu-gdpr.yaml"
    health = load_policies(POLICIES / "health")
    assert health.problems == () and sorted(health.by_jurisdiction) == ["EU", "US"]
    for jurisdiction, loaded in health.by_jurisdiction.items():
        strict, usual = loaded.policy.privacy, general.require(jurisdiction).policy.privacy
        assert strict.unit == "user"
        assert strict.max_epsilon_per_run < usual.max_epsilon_per_run
        assert strict.max_lifetime_epsilon < usual.max_lifetime_epsilon
        record = check_run(jurisdiction.lower(), loaded, replace(GOOD, privacy_unit="record"))
        assert any(r.endswith("(privacy.unit)") for r in record.reasons)


# -- the agent's version ----------------------------------------------------------------


def _requiring(loaded: LoadedPolicy, version: str) -> LoadedPolicy:
    policy = loaded.policy.model_copy(update={"agent": Agent(min_version=version)})
    return LoadedPolicy(policy, loaded.path)


@pytest.mark.parametrize(
    ("declared", "rule"),
    [
        ("0.3.0", None),
        ("0.10.0", None),  # versions compare as versions, not as text
        ("0.2.9", "agent fedciuic 0.2.9 < 0.3.0 (agent.min_version)"),
        (None, "agent version undeclared"),
        ("not-a-version", "is not a version"),
    ],
)
def test_an_update_from_an_agent_older_than_the_senders_policy_requires_is_rejected(
    eu, declared, rule
):
    strict = _requiring(eu, "0.3.0")
    facts = replace(FACTS, policy_hash=strict.hash, agent_version=declared)
    decision = check_update(strict, facts, GOOD)
    if rule is None:
        assert decision.accepted
    else:
        assert decision.outcome == "reject" and rule in decision.reasons[0]
    # Without the section any version (or none) will do.
    assert check_update(eu, replace(facts, policy_hash=eu.hash), GOOD).accepted


def test_an_agent_refuses_to_serve_under_a_policy_it_is_too_old_for(eu, tmp_path):
    too_old = _requiring(eu, "99.0")
    with pytest.raises(PolicyError, match=r"agent fedciuic 0\.1\.0 < 99\.0.*upgrade"):
        too_old.check_agent("0.1.0")
    _requiring(eu, "0.1.0").check_agent("0.1.0")  # at the minimum: serves


def test_the_agent_section_parses_a_version_and_changes_the_hash(tmp_path, eu):
    text = (ROOT / "policies" / "eu-gdpr.yaml").read_text()
    good = tmp_path / "good.yaml"
    good.write_text(text + 'agent:\n  min_version: "0.2.0"\n')
    loaded = load_policy(good)
    assert loaded.policy.agent is not None and loaded.policy.agent.min_version == "0.2.0"
    assert loaded.hash != load_policy(ROOT / "policies" / "eu-gdpr.yaml").hash
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "agent:\n  min_version: soon\n")
    with pytest.raises(PolicyError, match=r"agent\.min_version.*not a version"):
        load_policy(bad)


def test_a_policy_can_allow_only_exact_adapter_modes_on_both_ends(tmp_path, eu):
    """The adapter-mode is the codec's other half: a policy that lists the modes it
    allows declines a run in another one and rejects its update; absent, every mode is
    allowed and the hash is the one the file had before modes existed."""
    exact = tmp_path / "eu.yaml"
    exact.write_text(
        edit(
            EU,
            "  allowed_codecs:",
            "  allowed_adapter_modes: [lora-fa, lora-sb]\n  allowed_codecs:",
        )
    )
    loaded = load_policy(exact)
    assert loaded.hash != eu.hash
    assert check_run("eu", eu, replace(GOOD, adapter_mode="lora-sb")).outcome == "accept"
    assert check_run("eu", loaded, replace(GOOD, adapter_mode="lora-sb")).outcome == "accept"
    declined = check_run("eu", loaded, GOOD)
    assert declined.reasons == (
        "adapter-mode lora not in lora-fa, lora-sb (compression.allowed_adapter_modes)",
    )
    rejected = check_update(loaded, replace(FACTS, policy_hash=loaded.hash), GOOD)
    assert rejected.outcome == "reject" and any(
        "compression.allowed_adapter_modes" in r for r in rejected.reasons
    )
    fa = replace(FACTS, adapter_mode="lora-fa", policy_hash=loaded.hash)
    assert check_update(loaded, fa, GOOD).accepted
    unknown = tmp_path / "bad.yaml"
    unknown.write_text(edit(exact.read_text(), "[lora-fa, lora-sb]", "[dora]"))
    with pytest.raises(PolicyError, match=r"bad.yaml:\d+: compression.allowed_adapter_modes"):
        load_policy(unknown)


# -- secure aggregation ------------------------------------------------------------------


def with_aggregation(loaded: LoadedPolicy, **change: object) -> LoadedPolicy:
    aggregation = loaded.policy.aggregation.model_copy(update=change)
    return LoadedPolicy(loaded.policy.model_copy(update={"aggregation": aggregation}), loaded.path)


SECURE = replace(GOOD, secure_aggregation=True, secure_threshold=3)


def test_a_policy_requiring_secure_aggregation_is_refused_by_both_ends_without_it(eu):
    strict = with_aggregation(eu, secure="required", min_secure_regions=3)
    run = check_run("eu", strict, GOOD)
    assert run.reasons == (
        "updates would reach the aggregator one by one, not inside a secure sum "
        "(aggregation.secure: required)",
    )
    facts = replace(FACTS, policy_hash=strict.hash)
    assert "(aggregation.secure: required)" in check_update(strict, facts, GOOD).reasons[0]
    assert check_run("eu", strict, SECURE).accepted
    secure_facts = replace(facts, secure_sum=True, secure_threshold=3)
    assert check_update(strict, secure_facts, GOOD).accepted
    fewer = check_run("eu", strict, replace(SECURE, secure_threshold=2))
    assert fewer.reasons == (
        "a secure sum unmasked from 2 region(s), the policy needs 3 "
        "(aggregation.min_secure_regions)",
    )


def test_distributed_dp_stands_in_for_dp_sgd_only_where_the_policy_allows_it(eu):
    shared_noise = replace(SECURE, dp=False, distributed_dp=True)
    assert check_run("eu", eu, shared_noise).reasons == (
        "local DP-SGD is off and distributed DP may not stand in for it "
        "(privacy.dp_required, aggregation.distributed_dp)",
    )
    assert check_run("eu", with_aggregation(eu, distributed_dp=True), shared_noise).accepted
    # without a secure sum there is nothing to share the noise in
    alone = replace(shared_noise, secure_aggregation=False)
    assert check_run("eu", with_aggregation(eu, distributed_dp=True), alone).reasons == (
        "DP is off (privacy.dp_required)",
    )


def test_the_aggregator_takes_distributed_dp_for_dp_sgd_only_where_the_policy_allows_it(eu):
    shared = replace(FACTS, policy_hash=eu.hash, epsilon=None, delta=None, max_grad_norm=None)
    shared = replace(shared, unit=None, secure_mode=None, secure_sum=True, secure_threshold=3)
    assert (
        "privacy.dp_required"
        in check_update(eu, replace(shared, distributed_dp=True), GOOD).reasons[0]
    )
    lenient = with_aggregation(eu, distributed_dp=True)
    shared = replace(shared, policy_hash=lenient.hash)
    assert check_update(lenient, replace(shared, distributed_dp=True), GOOD).accepted
    assert "privacy.dp_required" in check_update(lenient, shared, GOOD).reasons[0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("  secure: maybe\n", r"aggregation\.secure: Input should be 'required' or 'allowed'"),
        ("  min_secure_regions: 1\n", r"aggregation\.min_secure_regions: Input should be greater"),
        ("  distributed_dp: yes\n", r"aggregation\.distributed_dp"),
    ],
)
def test_a_malformed_secure_aggregation_key_is_refused_naming_it(tmp_path, line, message):
    path = tmp_path / "p.yaml"
    path.write_text(edit(EU, "aggregation:\n", "aggregation:\n" + line))
    with pytest.raises(PolicyError, match=rf"p\.yaml:\d+: {message}"):
        load_policy(path)


@pytest.mark.parametrize(
    ("new", "message"),
    [
        ("required: true\n  entities: [EMAIL]", r"entities: Value error, unknown entity type"),
        ("required: true\n  entities: []", r"entities: Tuple should have at least 1 item"),
        ("required: true\n  entities: [URL, URL]", r"entities: .*URL listed more than once"),
        ("required: 1\n  entities: [direct]", r"required: Input should be a valid boolean"),
        ("required: true\n  entities: [names, NAMES]", r"entities: Value error, unknown"),
    ],
)
def test_a_malformed_deidentification_section_is_refused_naming_its_line_and_field(
    tmp_path, new, message
):
    path = tmp_path / "p.yaml"
    path.write_text(edit(EU, "  required: true\n  entities: [direct, names]\n", f"  {new}\n"))
    with pytest.raises(PolicyError, match=rf"p\.yaml:\d+: deidentification\.{message}"):
        load_policy(path)


def test_a_policy_without_a_deidentification_section_requires_none(eu):
    absent = LoadedPolicy(eu.policy.model_copy(update={"deidentification": None}), eu.path)
    assert check_run("eu", absent, replace(GOOD, deid_entities=())).accepted
    assert not check_run("eu", eu, replace(GOOD, deid_entities=())).accepted


# -- privacy.releases: dp_only ------------------------------------------------------------


def _dp_only(path: Path, releases: str = "dp_only") -> LoadedPolicy:
    return load_policy(write_policy(path, "EU", privacy__releases=releases, privacy__unit="user"))


def test_the_shipped_eu_and_cn_policies_let_out_only_dp_releases(eu):
    assert eu.policy.privacy.releases == DP_ONLY
    assert load_policy(POLICIES / "cn-pipl.yaml").policy.privacy.releases == DP_ONLY


def test_a_dp_only_policy_declines_a_run_whose_replies_carry_data_figures(tmp_path):
    exact = {**unit_config(), **EXACT_RELEASES}
    figures = unavoidable(RunConfig.from_user_config(exact, source="run config"))
    anything = _dp_only(tmp_path / "any.yaml", "any")
    assert check_run("eu", anything, replace(GOOD, data_releases=figures)).accepted
    decision = check_run("eu", _dp_only(tmp_path / "eu.yaml"), replace(GOOD, data_releases=figures))
    assert not decision.accepted
    (reason,) = decision.reasons
    assert reason.startswith("the run's replies would carry figures of the region's data")
    assert "num-examples: the region's training example count" in reason
    assert reason.endswith("(privacy.releases: dp_only)")
    assert check_run("eu", _dp_only(tmp_path / "eu2.yaml"), GOOD).accepted


def test_the_aggregator_rejects_a_reply_with_data_figures_from_a_dp_only_region(tmp_path):
    dp_only = _dp_only(tmp_path / "eu.yaml")
    facts = replace(FACTS, policy_hash=dp_only.hash)
    assert check_update(dp_only, facts, GOOD).accepted
    figures = ("train-loss: the mean loss of the round's training batches",)
    decision = check_update(dp_only, replace(facts, data_fields=figures), GOOD)
    assert decision.reasons == (
        "the reply would carry figures of the region's data outside DP: "
        f"{figures[0]} (privacy.releases: dp_only)",
    )
