"""Strict policy YAML: one meaning per file, every refusal as ``FILE:LINE: field: message``.

Each test names the class of defect it closes; the cases are examples of the class.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.policy.binding import AggregatorPolicies, PolicyRefusal, enforce_region_policy
from fedciuic.policy.rules import (
    MAX_POLICY_BYTES,
    MAX_POLICY_DEPTH,
    MAX_POLICY_NODES,
    Policy,
    PolicyError,
    UpdateFacts,
    load_policies,
    load_policy,
)
from tests.conftest import ROOT

POLICIES = ROOT / "policies"
EU = (POLICIES / "eu-gdpr.yaml").read_text()
EU_HASH = load_policy(POLICIES / "eu-gdpr.yaml").hash
SECURE_KEYS = ("secure", "min_secure_regions", "distributed_dp")


def refusal(tmp_path: Path, content: str | bytes, name: str = "p.yaml") -> str:
    """The one-line refusal of ``content``, checked to be ``FILE:LINE: ...``."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    for problem in caught.value.problems:
        assert re.match(rf"{re.escape(str(path))}:\d+: \S", problem), problem
    return "\n".join(caught.value.problems)


def line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


#: Fields a shipped policy may leave out (their defaults), added where a test sets them.
OPTIONAL = {"min_secure_regions": "  min_secure_regions: 2\n"}


def set_field(text: str, name: str, value: str) -> str:
    """``text`` with the value of the (unique) field ``name`` replaced."""
    if name in OPTIONAL and f"{name}:" not in text:
        text = text.replace("aggregation:\n", "aggregation:\n" + OPTIONAL[name])
    new, count = re.subn(rf"(?m)^(\s*{name}:) .*$", rf"\g<1> {value}", text)
    assert count == 1, name
    return new


# -- duplicate keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (EU + "privacy:\n  dp_required: false\n", "privacy"),
        (
            EU.replace("  dp_required: true\n", "  dp_required: true\n  dp_required: false\n"),
            "privacy.dp_required",
        ),
        (
            EU.replace("  dp_required: true\n", '  dp_required: true\n  "dp_required": false\n'),
            "privacy.dp_required",
        ),
        (EU.replace("version: 1\n", "version: 1\nversion: 1\n"), "version"),
        (
            EU.replace("  min_regions: 2\n", "  min_regions: 2\n  min_regions: 1\n"),
            "aggregation.min_regions",
        ),
        (EU.replace("laws:\n", "laws:\n  - {a: 1, a: 2}\n"), "laws.0.a"),
    ],
    ids=["section", "field", "quoted-twin", "top-level-field", "count", "inside-a-list"],
)
def test_duplicate_key_is_refused_naming_both_lines(tmp_path, content, where):
    key = where.rsplit(".", 1)[-1]
    first, second = [
        content[: m.start()].count("\n") + 1
        for m in re.finditer(rf'(?m)(^\s*|{{|, )"?{key}"?:', content)
    ]
    message = refusal(tmp_path, content)
    assert f"p.yaml:{second}: {where}: duplicate key" in message
    assert f"lines {first} and {second}" in message


# -- plain YAML only -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "!!set {EU, US}",
        "!!python/object/apply:os.system [echo]",
        "!!python/name:os.system",
        "!!binary RVU=",
        "!custom EU",
        "!!str EU",
        "! EU",
        "!<tag:yaml.org,2002:str> EU",
        "!e!x EU",
    ],
)
def test_explicit_tag_is_refused(tmp_path, value):
    text = EU.replace("aggregator_jurisdictions: [EU, EEA,", f"aggregator_jurisdictions: [{value},")
    if value.startswith("!e!"):
        text = "%TAG !e! tag:example.com,2000:\n---\n" + text
    message = refusal(tmp_path, text)
    assert re.search(
        r"p\.yaml:\d+: transfers\.aggregator_jurisdictions\.0: tag .* is not allowed", message
    )


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    # Nine levels of ten aliases each: 10**9 strings if anything expanded it.
    lines = ['a0: &a0 ["' + "x" * 100_000 + '"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    started = time.monotonic()
    message = refusal(tmp_path, "\n".join(lines) + "\n" + EU)
    assert time.monotonic() - started < 5
    assert "p.yaml:1: a0: anchors (&name) and aliases (*name) are not allowed" in message


@pytest.mark.parametrize(
    "content",
    [
        EU.replace("  dp_required: true\n", "  dp_required: &on true\n"),
        EU.replace("laws:\n", "laws: &laws\n"),
    ],
    ids=["anchor-on-a-scalar", "anchor-on-a-list"],
)
def test_anchor_alone_is_refused(tmp_path, content):
    assert "anchors (&name) and aliases (*name) are not allowed" in refusal(tmp_path, content)


def test_merge_key_is_refused(tmp_path):
    text = EU.replace("  dp_required: true\n", "  <<: {dp_required: false}\n  dp_required: true\n")
    line = line_of(text, "<<")
    assert f"p.yaml:{line}: privacy: merge keys (<<) are not allowed" in refusal(tmp_path, text)


@pytest.mark.parametrize(
    "content",
    [
        "[" * 1_000,
        "[" * 100_000,
        "{a: " * 1_000,
        "{a: " * 100_000,
        "- " * 100_000 + "x\n",
        "".join(" " * i + "a:\n" for i in range(1_000)),
        EU + "extra:\n" + "".join(" " * (i + 1) + "- \n" for i in range(1_000)),
    ],
    ids=[
        "1k-flow-lists",
        "100k-flow-lists",
        "1k-flow-maps",
        "100k-flow-maps",
        "100k-block-lists",
        "1k-block-maps",
        "deep-inside-a-policy",
    ],
)
def test_deep_nesting_is_refused_without_recursion(tmp_path, content):
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)  # far below what any unbounded recursion would need
    try:
        message = refusal(tmp_path, content)
    finally:
        sys.setrecursionlimit(limit)
    assert f"nested deeper than {MAX_POLICY_DEPTH} levels" in message


def test_oversized_file_is_refused(tmp_path):
    message = refusal(tmp_path, EU + "#" * MAX_POLICY_BYTES)
    assert "p.yaml:1: (file): larger than 1024 KiB" in message


@pytest.mark.parametrize(
    "laws",
    [
        "[" + "a," * 500_000 + "a]",
        "\n" + "  - GDPR\n" * 80_000,
    ],
    ids=["flow", "block"],
)
def test_too_many_values_are_refused_quickly(tmp_path, laws):
    text = EU.replace('laws:\n  - "GDPR (EU) 2016/679"\n', f"laws: {laws}\n")
    started = time.monotonic()
    message = refusal(tmp_path, text)
    assert time.monotonic() - started < 5
    assert f"more than {MAX_POLICY_NODES} values" in message


def test_many_problems_are_counted_past_a_bound(tmp_path):
    laws = "[" + ", ".join(str(i) for i in range(500)) + "]"
    text = EU.replace('laws:\n  - "GDPR (EU) 2016/679"\n', f"laws: {laws}\n")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert len(caught.value.problems) == 51
    assert re.fullmatch(
        rf"{re.escape(str(path))}: \.\.\. and 4\d\d more problems", caught.value.problems[-1]
    )


def test_a_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    with pytest.raises(PolicyError, match="not a regular file"):
        load_policy(fifo)


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029"])
def test_a_line_separator_yaml_versions_disagree_on_is_refused(tmp_path, char):
    text = EU.replace("min_regions: 2", f"min_regions: 2 #{char}")
    line = line_of(text, "min_regions:")
    message = refusal(tmp_path, text)
    assert f"p.yaml:{line}: (file): character U+{ord(char):04X} is not allowed" in message


def test_more_than_one_document_is_refused(tmp_path):
    message = refusal(tmp_path, EU + "---\n" + EU)
    assert "expected a single document" in message


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("NO", '"NO"'),
        ("yes", '"yes"'),
        ("Off", '"Off"'),
    ],
)
def test_yaml_1_1_booleans_are_refused(tmp_path, value, hint):
    text = EU.replace('"NO"', value)
    message = refusal(tmp_path, text)
    line = line_of(text, "aggregator_jurisdictions:")
    assert f"p.yaml:{line}: transfers.aggregator_jurisdictions.4: '{value}' is a boolean" in message
    assert hint in message


@pytest.mark.parametrize("value", ["0100", "1_00", "0x64", "0b1100100", "1:40", "1:40.0", "1_0.0"])
def test_numbers_with_two_yaml_meanings_are_refused(tmp_path, value):
    text = set_field(EU, "min_examples", value)
    line = line_of(text, "min_examples:")
    message = refusal(tmp_path, text)
    assert f"p.yaml:{line}: aggregation.min_examples: '{value}' is read differently" in message


def test_exponent_without_a_dot_is_a_number(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(set_field(EU, "max_delta", "1e-5"))
    assert load_policy(path).hash == EU_HASH


# -- numbers -------------------------------------------------------------------------------


def numeric_fields() -> list[str]:
    """Every int and float field of the Policy model, as ``section.field``."""
    found = []
    for section, info in Policy.model_fields.items():
        model = info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for name, field in model.model_fields.items():
            base = typing.get_args(field.annotation) or (field.annotation,)
            if base[0] in (int, float):
                found.append(f"{section}.{name}")
    return found


NUMERIC = numeric_fields()


def test_numeric_fields_are_the_eight_bounds():
    assert len(NUMERIC) == 8 and "aggregation.min_secure_regions" in NUMERIC


@pytest.mark.parametrize("dotted", NUMERIC)
@pytest.mark.parametrize(
    "value", [".inf", "-.inf", ".nan", ".NaN", "1.0e+400", "-1.0e+400", "1e999"]
)
def test_non_finite_or_overflowing_bound_is_refused(tmp_path, dotted, value):
    name = dotted.split(".")[1]
    text = set_field(EU, name, value)
    message = refusal(tmp_path, text)
    assert f"p.yaml:{line_of(text, name + ':')}: {dotted}: " in message


@pytest.mark.parametrize("dotted", NUMERIC)
@pytest.mark.parametrize(
    "value", ["true", "false", "True", '"8"', "'1'", "[1]", "{a: 1}", "~", '""']
)
def test_bool_string_or_collection_is_never_a_number(tmp_path, dotted, value):
    name = dotted.split(".")[1]
    text = set_field(EU, name, value)
    message = refusal(tmp_path, text)
    assert f"p.yaml:{line_of(text, name + ':')}: {dotted}: " in message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("min_regions", "2.5"),
        ("min_regions", "2.0"),
        ("min_regions", "0"),
        ("min_examples", "-1"),
        ("retention_days", "1e3"),
        ("min_examples", "9007199254740992"),
        ("max_delta", "1.0"),
        ("max_delta", "0"),
        ("max_epsilon_per_run", "-8.0"),
        ("max_clipping_norm", "0.0"),
    ],
)
def test_count_or_bound_out_of_its_range_is_refused(tmp_path, name, value):
    text = set_field(EU, name, value)
    assert f"p.yaml:{line_of(text, name + ':')}: " in refusal(tmp_path, text)


def test_a_whole_number_is_a_float_bound(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(set_field(EU, "max_epsilon_per_run", "8"))
    assert load_policy(path).hash == EU_HASH


@pytest.mark.parametrize("name", ["dp_required", "relay_in_third_country", "redact_paths"])
@pytest.mark.parametrize("value", ['"true"', "1", "0", "~"])
def test_anything_but_true_or_false_is_not_a_flag(tmp_path, name, value):
    text = set_field(EU, name, value)
    assert f"p.yaml:{line_of(text, name + ':')}: " in refusal(tmp_path, text)


@pytest.mark.parametrize("value", ["true", "1.0", '"1"', "2"])
def test_version_is_the_integer_one(tmp_path, value):
    assert "p.yaml:3: version: " in refusal(tmp_path, set_field(EU, "version", value))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("[xwing-aes256gcm]", "[xwing-aes256gcm, xwing-aes256gcm]"),
        ("[dense, int8,", "[dense, dense, int8,"),
        ("[EU, EEA,", "[EU, EU, EEA,"),
    ],
)
def test_a_list_entry_repeated_is_refused(tmp_path, old, new):
    assert "listed more than once" in refusal(tmp_path, EU.replace(old, new))


# -- the hash ------------------------------------------------------------------------------

_HASH_SCRIPT = (
    "import sys; from pathlib import Path; from fedciuic.policy.rules import load_policy; "
    "print(' '.join(load_policy(Path(p)).hash for p in sys.argv[1:]))"
)


def test_policy_hash_is_the_same_in_every_process_whatever_pythonhashseed():
    files = [str(p) for p in sorted(POLICIES.glob("*.yaml"))]
    hashes = set()
    for seed in ("0", "1", "4242", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT, *files],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        hashes.add(out.stdout.strip())
    assert hashes == {" ".join(load_policy(Path(p)).hash for p in files)}


def test_policy_hash_is_the_sha256_of_the_canonical_json():
    import hashlib

    def sha256(data: object) -> str:
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    loaded = load_policy(POLICIES / "eu-gdpr.yaml")
    data = loaded.policy.model_dump(mode="json")
    # No agent section (any agent version) is left out: shipped policies keep their hash;
    # so is allowed_adapter_modes when it allows every mode.
    assert data.pop("agent") is None
    assert set(data["compression"].pop("allowed_adapter_modes")) == {"lora", "lora-fa", "lora-sb"}
    # and so are the secure-aggregation keys at their defaults
    secure = {k: data["aggregation"].pop(k) for k in SECURE_KEYS}
    assert secure == {"secure": "allowed", "min_secure_regions": 2, "distributed_dp": False}
    # privacy.releases, set (dp_only), is kept: only its default (any) is left out
    assert data["privacy"]["releases"] == "dp_only"
    assert loaded.hash == sha256(data)
    # The default privacy.unit (record) is left out: older policies keep their hash.
    cn = load_policy(POLICIES / "cn-pipl.yaml")
    data = cn.policy.model_dump(mode="json")
    assert data["privacy"].pop("unit") == "record"
    assert data["privacy"]["releases"] == "dp_only"
    assert data.pop("agent") is None
    data["compression"].pop("allowed_adapter_modes")
    for key in SECURE_KEYS:
        data["aggregation"].pop(key)
    assert cn.hash == sha256(data)
    # An agent section, once there, is hashed like any other.
    pinned = Policy.model_validate(
        {**loaded.policy.model_dump(), "agent": {"min_version": "0.2.0"}}
    )
    data = pinned.model_dump(mode="json")
    assert data["agent"] == {"min_version": "0.2.0"}
    data["compression"].pop("allowed_adapter_modes")  # every mode: left out, as above
    for key in SECURE_KEYS:
        data["aggregation"].pop(key)
    assert pinned.content_hash == sha256(data) != loaded.hash

    def changed(section: str, key: str, value: object) -> Policy:
        dumped = loaded.policy.model_dump()
        return Policy.model_validate({**dumped, section: {**dumped[section], key: value}})

    # So is a secure-aggregation key set away from its default.
    strict = changed("aggregation", "secure", "required")
    data = strict.model_dump(mode="json")
    data.pop("agent")
    data["compression"].pop("allowed_adapter_modes")
    data["aggregation"].pop("min_secure_regions")
    data["aggregation"].pop("distributed_dp")
    assert strict.content_hash == sha256(data) != loaded.hash
    # And privacy.releases at its default (any) is left out: older policies keep their hash.
    anything = changed("privacy", "releases", "any")
    data = anything.model_dump(mode="json")
    data.pop("agent")
    data["compression"].pop("allowed_adapter_modes")
    for key in SECURE_KEYS:
        data["aggregation"].pop(key)
    assert data["privacy"].pop("releases") == "any"
    assert anything.content_hash == sha256(data) != loaded.hash


# -- bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "what"),
    [
        (b"min_regions: 2", b"min_regions: 2\x00", "a NUL byte"),
        (b"# European", b"\x00# European", "a NUL byte"),
        (b"min_regions: 2", b"min_regions: 2\x01", "U+0001"),
        (b"GDPR (EU)", b"GDPR \xff(EU)", "byte 0xff is not valid UTF-8"),
        (b"# Art. 30", b"# Art. \xc3(30", "byte 0xc3 is not valid UTF-8"),
        (b"min_examples: 100", b"min_examples: 100\xed\xa0\x80", "byte 0xed is not valid UTF-8"),
    ],
    ids=["nul", "leading-nul", "control", "invalid-utf8", "in-a-comment", "surrogate"],
)
def test_nul_or_invalid_utf8_is_reported_at_its_line(tmp_path, old, new, what):
    content = EU.encode()
    assert old in content
    line = content[: content.index(old)].count(b"\n") + 1
    message = refusal(tmp_path, content.replace(old, new, 1))
    assert message.startswith(f"{tmp_path / 'p.yaml'}:{line}: (file): ") and what in message


def test_utf16_is_reported_as_not_utf8(tmp_path):
    message = refusal(tmp_path, EU.encode("utf-16"))
    assert message.startswith(f"{tmp_path / 'p.yaml'}:1: (file): ") and "not valid UTF-8" in message


# -- a folder of policies ------------------------------------------------------------------

BAD_FILES: dict[str, str | bytes] = {
    "deep.yaml": "[" * 100_000,
    "nul.yaml": EU.replace("jurisdiction: EU", "jurisdiction: CN\x00"),
    "dup.yaml": EU.replace("jurisdiction: EU", "jurisdiction: CN\njurisdiction: US"),
    "bomb.yaml": "a: &a [x, x]\nb: [*a, *a]\n" + EU.replace("jurisdiction: EU", "jurisdiction: CN"),
    "set.yaml": EU.replace("jurisdiction: EU", "jurisdiction: SG").replace(
        'laws:\n  - "GDPR (EU) 2016/679"', "laws: !!set {a, b}"
    ),
    "inf.yaml": set_field(EU.replace("jurisdiction: EU", "jurisdiction: IN"), "max_delta", ".inf"),
    "utf8.yaml": EU.replace("jurisdiction: EU", "jurisdiction: CN").encode("utf-16"),
    "huge.yaml": EU + "#" * (MAX_POLICY_BYTES + 1),
}


def bad_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "eu.yaml").write_text(EU)
    for name, content in BAD_FILES.items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content)
    (folder / "dir.yaml").mkdir()
    return folder


def test_a_bad_file_in_a_policies_folder_is_listed_and_the_good_ones_load(tmp_path):
    found = load_policies(bad_folder(tmp_path / "policies"))
    assert sorted(found.by_jurisdiction) == ["EU"] and found.require("EU").hash == EU_HASH
    assert len(found.problems) == len(BAD_FILES) + 1
    for name in [*BAD_FILES, "dir.yaml"]:
        (problem,) = [p for p in found.problems if p.startswith(str(tmp_path / "policies" / name))]
        assert "Traceback" not in problem
    with pytest.raises(PolicyError, match=r"no valid policy for jurisdiction CN.*nul\.yaml:\d+: "):
        found.require("CN")  # whoever needs CN's policy can still refuse the run


def test_the_aggregator_loads_a_folder_with_bad_files_and_rejects_their_regions(
    tmp_path, run_config: RunConfig
):
    folder = bad_folder(tmp_path / "policies")
    policies = AggregatorPolicies.load(run_config.updated(**{"policies_dir": str(folder)}))
    assert sorted(policies.policies.by_jurisdiction) == ["EU"]
    facts = UpdateFacts(
        region="cn",
        sender_jurisdiction="CN",
        policy_hash="",
        epsilon=1.0,
        delta=1e-5,
        suite="xwing-aes256gcm",
        codec="topk-int8",
        num_examples=100,
    )
    decision = policies.check_update(facts)
    assert decision.outcome == "reject"
    assert re.search(r"dup\.yaml:\d+: jurisdiction: duplicate key", decision.reasons[0])


def test_three_policies_for_one_jurisdiction_trust_none(tmp_path):
    for name in ("a.yaml", "b.yaml", "c.yaml"):
        (tmp_path / name).write_text(EU)
    found = load_policies(tmp_path)
    assert found.get("EU") is None and len(found.problems) == 2


# -- a region holds its own jurisdiction's policy ------------------------------------------


def node(tmp_path: Path, region: str, policy: str) -> NodeConfig:
    """A deployed region with its policy and its dictionary of names."""
    return NodeConfig(
        region=region,
        data_path=str(tmp_path / region),
        policy=str(POLICIES / policy),
        deid_dictionary=str(tmp_path / "names.txt"),
    )


@pytest.mark.parametrize("simulated", [False, True])
def test_a_region_refuses_a_policy_of_another_jurisdiction(tmp_path, run_config, simulated):
    cn = node(tmp_path, "cn", "us-ccpa.yaml")
    with pytest.raises(PolicyRefusal) as caught:
        enforce_region_policy(
            run_config,
            cn,
            simulated=simulated,
            aggregator_jurisdiction="US",
            own_jurisdiction="CN",
        )
    message = str(caught.value)
    assert "us-ccpa.yaml is the policy of US, but region cn is in CN (its key)" in message
    assert caught.value.decision.outcome == "decline"


def test_a_simulated_region_without_a_key_is_in_its_named_jurisdiction(tmp_path, run_config):
    with pytest.raises(PolicyRefusal, match=r"region cn is in CN \(its simulated region name\)"):
        enforce_region_policy(
            run_config,
            node(tmp_path, "cn", "us-ccpa.yaml"),
            simulated=True,
            aggregator_jurisdiction="US",
            own_jurisdiction=None,
        )


def test_a_region_with_its_own_jurisdictions_policy_is_checked_as_before(tmp_path, run_config):
    checked = enforce_region_policy(
        run_config,
        node(tmp_path, "cn", "cn-pipl.yaml"),
        simulated=False,
        aggregator_jurisdiction="EU",
        own_jurisdiction="CN",
    )
    assert checked.decision.accepted and checked.decision.enforced and checked.jurisdiction == "CN"
    with pytest.raises(PolicyRefusal) as caught:  # every reason, the mismatch first
        enforce_region_policy(
            run_config,
            node(tmp_path, "cn", "eu-gdpr.yaml"),
            simulated=False,
            aggregator_jurisdiction="CN",
            own_jurisdiction="CN",
        )
    reasons = caught.value.decision.reasons
    assert (
        "is the policy of EU" in reasons[0] and "transfers.aggregator_jurisdictions" in reasons[1]
    )


def test_a_lab_region_without_a_policy_obeys_none_and_its_decision_is_not_enforced(
    tmp_path, run_config
):
    lab = run_config.updated(**{"enforce_policies": False})
    none = enforce_region_policy(
        lab,
        NodeConfig(region="eu", data_path=str(tmp_path / "eu")),
        simulated=True,
        aggregator_jurisdiction="EU",
        own_jurisdiction=None,
    )
    assert (none.hash, none.jurisdiction, none.max_epsilon_per_run) == ("", "", None)
    assert none.redacts_paths and none.decision.accepted and not none.decision.enforced


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"deidentify": False}, "de-identification is off (deidentification.required)"),
        (
            {"deid_entities": ("EMAIL_ADDRESS", "PHONE_NUMBER", "names")},
            "de-identification does not scrub CN_RESIDENT_ID, US_SSN, CREDIT_CARD, IBAN_CODE, "
            "IP_ADDRESS, URL, ES_NIF, ES_NIE, IT_FISCAL_CODE, PL_PESEL, "
            "FI_PERSONAL_IDENTITY_CODE, SE_PERSONNUMMER (deidentification.entities)",
        ),
    ],
)
def test_a_region_whose_policy_requires_scrubbing_refuses_a_run_without_it(
    tmp_path, run_config, changes, reason
):
    """The shipped CN policy requires the direct identifiers and names scrubbed: one
    line, naming the policy field; the default run scrubs them (the region has its
    dictionary) and is accepted."""
    cn = node(tmp_path, "cn", "cn-pipl.yaml")
    terms = {"aggregator_jurisdiction": "CN", "own_jurisdiction": "CN", "simulated": True}
    assert enforce_region_policy(run_config, cn, **terms).decision.accepted  # type: ignore[arg-type]
    with pytest.raises(PolicyRefusal) as caught:
        enforce_region_policy(run_config.updated(**changes), cn, **terms)  # type: ignore[arg-type]
    assert caught.value.decision.reasons == (reason,)
    message = str(caught.value)
    assert "\n" not in message and message.endswith(reason), message


@pytest.mark.parametrize(("region", "policy"), [("cn", "cn-pipl.yaml"), ("eu", "eu-gdpr.yaml")])
def test_a_region_without_a_name_dictionary_or_ner_model_declines_under_the_shipped_policies(
    tmp_path, run_config, region, policy
):
    """The shipped CN and EU policies require names: finding them by context alone does
    not meet it; a dictionary or a NER model does. One line, naming the policy field and
    both agent keys."""
    run = run_config.updated(**{"privacy_unit": "user"})  # the EU policy's unit
    bare = node(tmp_path, region, policy).model_copy(update={"deid_dictionary": ""})
    terms = {
        "aggregator_jurisdiction": region.upper(),
        "own_jurisdiction": region.upper(),
        "simulated": True,
    }
    with pytest.raises(PolicyRefusal) as caught:
        enforce_region_policy(run, bare, **terms)
    assert caught.value.decision.reasons == (
        "names are required (deidentification.entities: names) but this region has neither "
        "a name dictionary nor a NER model: set deid-dictionary or deid-ner-model in its "
        "agent config",
    )
    assert bare.deid_entities(run)[-1] == "CONTEXT_NAME"
    for means in ({"deid_dictionary": str(tmp_path / "names.txt")}, {"deid_ner_model": "ner"}):
        equipped = bare.model_copy(update=means)
        assert enforce_region_policy(run, equipped, **terms).decision.accepted
