"""The `fedciuic` command's non-simulation subcommands, called as a user would."""

from __future__ import annotations

import argparse
import json
import re
import stat
from pathlib import Path

import pytest

from fedciuic.audit.log import AuditLog
from fedciuic.crypto.keys import Keypair, write_keys
from fedciuic.data.demo import CHAT_FILE, DOCS_FILE, INSTRUCTIONS_FILE
from fedciuic.ops.cli import _parser, main
from fedciuic.ops.simulate import cpus_per_region
from tests.conftest import ROOT


def test_keys_generate_then_show(tmp_path, capsys):
    assert (
        main(
            [
                "keys",
                "generate",
                "--party",
                "eu",
                "--jurisdiction",
                "EU",
                "--out",
                str(tmp_path),
                "--signature",
                "ed25519+mldsa65",
            ]
        )
        == 0
    )
    private = tmp_path / "eu.key.json"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    capsys.readouterr()
    assert main(["keys", "show", str(tmp_path / "eu.pub.json")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["party"] == "eu" and shown["signature"] == "ed25519+mldsa65"
    assert main(["keys", "show", str(private)]) == 0
    assert json.loads(capsys.readouterr().out)["key_id"] == shown["key_id"]


def test_keys_errors_are_one_line_without_traceback(tmp_path, capsys):
    assert main(["keys", "show", str(tmp_path / "missing.pub.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.pub.json: no public bundle here" in err
    assert (
        main(["keys", "generate", "--party", "EU!", "--jurisdiction", "EU", "--out", str(tmp_path)])
        == 2
    )
    assert "--party: 'EU!' must be lower-case" in capsys.readouterr().err


def test_demo_data_writes_one_folder_per_region(tmp_path, capsys):
    assert main(["demo-data", str(tmp_path), "--regions", "eu,cn"]) == 0
    for region in ("eu", "cn"):
        files = sorted(p.name for p in (tmp_path / region).iterdir())
        assert files == sorted((CHAT_FILE, DOCS_FILE, INSTRUCTIONS_FILE))


POLICIES = ROOT / "policies"


def test_policy_check_accepts_the_shipped_policies(capsys):
    """Every shipped file, the health ones in policies/health/ included."""
    files = sorted(str(p) for p in [*POLICIES.glob("*.yaml"), *POLICIES.glob("health/*.yaml")])
    assert main(["policy", "check", *files]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == len(files) == 7


def test_policy_check_lists_every_problem_as_file_line_field_message(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (POLICIES / "eu-gdpr.yaml")
        .read_text()
        .replace("min_regions: 2", "min_regions: two")
        .replace("audit:", "audit:\n  shred: true")
    )
    assert main(["policy", "check", str(POLICIES / "us-ccpa.yaml"), str(bad)]) == 1
    captured = capsys.readouterr()
    assert "us-ccpa.yaml: ok" in captured.out
    problems = captured.err.strip().splitlines()
    assert len(problems) == 2
    assert re.fullmatch(rf"{re.escape(str(bad))}:\d+: aggregation\.min_regions: .*", problems[0])
    assert re.fullmatch(rf"{re.escape(str(bad))}:\d+: audit\.shred: Extra inputs.*", problems[1])
    assert "Traceback" not in captured.err


def test_policy_explain_says_where_updates_may_go(capsys):
    assert main(["policy", "explain", str(POLICIES / "cn-pipl.yaml")]) == 0
    out = capsys.readouterr().out
    assert "Jurisdiction CN" in out and "aggregator in: CN, EU" in out
    assert "must also sit in one of those jurisdictions" in out
    assert "not legal advice" in out


def test_policy_diff_lists_each_differing_rule(capsys):
    a, b = POLICIES / "eu-gdpr.yaml", POLICIES / "cn-pipl.yaml"
    assert main(["policy", "diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "transfers.relay_in_third_country: true -> false" in out
    assert 'jurisdiction: "EU" -> "CN"' in out
    assert main(["policy", "diff", str(a), str(a)]) == 0
    assert "no differences" in capsys.readouterr().out


def test_policy_commands_on_a_missing_file_give_one_line(tmp_path, capsys):
    assert main(["policy", "explain", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"fedciuic: error: {tmp_path / 'nope.yaml'}: no policy file here; copy one "
        "from policies/ and adapt it"
    )


# -- audit ------------------------------------------------------------------------------


def small_federation(tmp_path: Path) -> tuple[Path, dict[str, Keypair]]:
    """The logs of one round: eu sent an update the aggregator received; cn declined."""
    keys = {
        p: Keypair.generate(p, p.upper() if p != "aggregator" else "EU")
        for p in ("aggregator", "eu", "cn")
    }
    for key in keys.values():
        write_keys(key, tmp_path / "keys")
    agg = AuditLog(tmp_path / "aggregator.audit.jsonl", "aggregator", keys["aggregator"])
    eu = AuditLog(tmp_path / "eu.jsonl", "eu", keys["eu"])
    cn = AuditLog(tmp_path / "cn.jsonl", "cn", keys["cn"])
    agg.append(
        "run_start",
        run_id=9,
        regions=["eu", "cn"],
        config_hash="c" * 64,
        aggregator_jurisdiction="EU",
        relay_jurisdiction="EU",
    )
    for log, j in ((eu, "EU"), (cn, "CN")):
        log.append("run_joined", run_id=9, server_round=1, config_hash="c" * 64, jurisdiction=j)
    eu.append("trained", run_id=9, server_round=1, epsilon=4.0, epsilon_budget=8.0)
    eu.append(
        "update_sealed",
        run_id=9,
        server_round=1,
        region="eu",
        digest="d" * 64,
        bytes=2200,
        suite="xwing-aes256gcm",
        destination="aggregator",
        destination_jurisdiction="EU",
    )
    cn.append(
        "declined", run_id=9, server_round=1, reason="aggregator in US, CN's policy allows CN"
    )
    agg.append(
        "update_received",
        run_id=9,
        server_round=1,
        region="eu",
        digest="d" * 64,
        bytes=2200,
        suite="sealed",
    )
    agg.append("update_accepted", run_id=9, server_round=1, region="eu", examples=60)
    agg.append("region_declined", run_id=9, server_round=1, region="cn", reason="policy")
    agg.append(
        "aggregate_withheld",
        run_id=9,
        server_round=1,
        regions=["eu"],
        reasons=["1 region(s) in the aggregate, the strictest policy needs 2"],
    )
    agg.append("run_end", run_id=9, status="completed", model_digest="m" * 64)
    for log in (agg, eu, cn):
        log.checkpoint(run_id=9)
        log.close()
    return tmp_path, keys


def test_audit_verify_says_ok_or_names_the_bad_record(tmp_path, capsys):
    folder, _ = small_federation(tmp_path)
    log, key = folder / "eu.jsonl", folder / "keys" / "eu.pub.json"
    assert main(["audit", "verify", str(log), "--pubkey", str(key)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {log}: 4 records (eu)")
    log.write_bytes(log.read_bytes().replace(b'"epsilon":4.0', b'"epsilon":0.4'))
    assert main(["audit", "verify", str(log), "--pubkey", str(key)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL: {log}: no checkpoint verified")
    assert "line 2 (seq 1, trained): changed" in out
    other = folder / "keys" / "cn.pub.json"
    assert main(["audit", "verify", str(folder / "cn.jsonl"), "--pubkey", str(other)]) == 0
    assert main(["audit", "verify", str(folder / "cn.jsonl"), "--pubkey", str(key)]) == 1
    assert "signed by another key" in capsys.readouterr().out


def test_audit_verify_on_bad_input_gives_a_verdict_not_a_traceback(tmp_path, capsys):
    folder, _ = small_federation(tmp_path)
    key = str(folder / "keys" / "eu.pub.json")
    (folder / "notes.txt").write_text("not a log\n")
    assert main(["audit", "verify", str(folder / "notes.txt"), "--pubkey", key]) == 1
    assert "line 1: not a fedciuic audit record" in capsys.readouterr().out
    assert main(["audit", "verify", str(folder / "missing.jsonl"), "--pubkey", key]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"fedciuic: error: {folder / 'missing.jsonl'}: no audit log here"
    (folder / "bad.pub.json").write_text("{}")
    assert (
        main(
            ["audit", "verify", str(folder / "eu.jsonl"), "--pubkey", str(folder / "bad.pub.json")]
        )
        == 2
    )
    assert "Traceback" not in capsys.readouterr().err


def test_audit_show_filters_by_region_round_and_event(tmp_path, capsys):
    folder, _ = small_federation(tmp_path)
    log = str(folder / "aggregator.audit.jsonl")
    assert main(["audit", "show", log, "--region", "cn"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "region_declined" in lines[0]
    assert main(["audit", "show", log, "--event", "update_received", "--round", "1"]) == 0
    assert "update_received" in capsys.readouterr().out
    assert main(["audit", "show", log, "--round", "5"]) == 0
    assert capsys.readouterr().out == ""


def test_audit_report_shows_transfers_refusals_and_agreement(tmp_path, capsys):
    folder, _ = small_federation(tmp_path)
    logs = [str(folder / n) for n in ("aggregator.audit.jsonl", "eu.jsonl", "cn.jsonl")]
    out = folder / "report"
    assert main(["audit", "report", *logs, "--keys", str(folder / "keys"), "--out", str(out)]) == 0
    text = (out / "compliance-report-run-9.md").read_text()
    assert "| eu | EU |" in text and "4.000 of 8" in text
    assert "| 1 | eu | aggregator (EU) | 2200 | xwing-aes256gcm | dddddddddddddddd | yes |" in text
    assert "| 1 | cn | declined | aggregator in US, CN's policy allows CN |" in text
    assert "withheld aggregate" in text
    assert "The region and aggregator logs agree." in text
    assert "GDPR Art. 30(1)" in text and "PIPL Art. 38-40" in text
    page = (out / "compliance-report-run-9.html").read_text()
    assert page.startswith("<!doctype html>") and "CN&#x27;s policy allows CN" in page


def test_audit_report_flags_logs_that_disagree(tmp_path, capsys):
    folder, _ = small_federation(tmp_path)
    eu = folder / "eu.jsonl"
    eu.write_text(eu.read_text().replace("d" * 64, "e" * 64))  # what eu says it sent
    logs = [str(folder / "aggregator.audit.jsonl"), str(eu), str(folder / "cn.jsonl")]
    out = folder / "report"
    assert main(["audit", "report", *logs, "--keys", str(folder / "keys"), "--out", str(out)]) == 1
    text = (out / "compliance-report-run-9.md").read_text()
    assert "The logs DISAGREE:" in text
    assert "eu logged sending eeeeeeeeeeeeeeee, the aggregator logged no such update" in text
    assert "| eu |" in text and "FAIL" in text  # and the tampered log does not verify


def _commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """Every command and action of the ``fedciuic`` parser, e.g. ("audit", "verify")."""
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


@pytest.mark.parametrize("command", _commands(_parser()), ids=" ".join)
def test_every_command_explains_its_options_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and "fedciuic " in out.split("example", 1)[1]


def test_data_check_reports_what_it_would_scrub_with_the_identifiers_masked(tmp_path, capsys):
    """Counts per entity type and per file, and masked examples: never a value."""
    assert main(["demo-data", str(tmp_path), "--regions", "cn"]) == 0
    names = tmp_path / "deid-dictionaries" / "cn.txt"
    capsys.readouterr()
    assert main(["data", "check", str(tmp_path / "cn"), "--deid-dictionary", str(names)]) == 0
    out = capsys.readouterr().out
    signed = [
        line for line in (tmp_path / "cn" / CHAT_FILE).read_text().splitlines() if "I am" in line
    ]
    n = len(signed)
    assert n > 0
    # direct's 14 types, the dictionary and names by context (no NER model)
    summary = re.search(r"^de-identification \(placeholder, 16 entity type\(s\), .*\n", out, re.M)
    assert summary and f"in {n} record(s)" in summary.group(), out
    each = (
        f"CN_RESIDENT_ID {n}, DICTIONARY (names, dictionary) {n}, EMAIL_ADDRESS {n}, "
        f"PHONE_NUMBER {n}"
    )
    assert f"  by entity type: {each}\n" in out
    assert f"  {CHAT_FILE}: {each}\n" in out
    examples = out.split("examples (identifiers masked):\n")[1].split("\n\n")[0].splitlines()
    assert examples and all(line.startswith(f"    {CHAT_FILE}:") for line in examples)
    for name in names.read_text().splitlines()[1:]:
        assert name not in out  # a dictionary name is shown masked only
    assert "@example.org" not in out and "+86" not in out
    assert main(["data", "check", str(tmp_path / "cn"), "--no-deidentify"]) == 0
    assert "de-identification: off (nothing would be scrubbed)" in capsys.readouterr().out
    # Without the dictionary the names are found by their context ("I am First Last"),
    # and the check says what a policy that requires names makes of that.
    assert main(["data", "check", str(tmp_path / "cn")]) == 0
    out = capsys.readouterr().out
    assert f"CONTEXT_NAME (names, by context) {n}" in out
    assert "  names: by their context only (no deid-dictionary, no deid-ner-model)" in out


def test_data_check_refuses_an_unknown_entity_type_and_a_malformed_dictionary(tmp_path, capsys):
    assert main(["demo-data", str(tmp_path), "--regions", "eu"]) == 0
    capsys.readouterr()
    assert main(["data", "check", str(tmp_path / "eu"), "--deid-entities", "EMAIL"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--deid-entities: unknown entity type 'EMAIL'" in err
    bad = tmp_path / "names.txt"
    bad.write_text("Zhang Wei\nJane\tRoe\n", encoding="utf-8")
    assert main(["data", "check", str(tmp_path / "eu"), "--deid-dictionary", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:2: holds a control character" in err, err


@pytest.mark.parametrize(
    ("regions", "cores", "each"),
    [(3, 2, 2), (3, 1, 1), (3, 3, 1), (3, 16, 1), (8, 4, 4), (1, 1, 1)],
)
def test_a_simulation_trains_one_region_at_a_time_only_where_the_cores_cannot_train_all(
    regions, cores, each
):
    assert cpus_per_region(regions, cores) == each
