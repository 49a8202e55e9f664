"""The `fedciuic` command's non-simulation subcommands, called as a user would."""

from __future__ import annotations

import json
import re
import stat

from fedciuic.cli import main
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
    assert (tmp_path / "eu" / "docs.jsonl").exists() and (tmp_path / "cn" / "docs.jsonl").exists()


POLICIES = ROOT / "policies"


def test_policy_check_accepts_the_shipped_policies(capsys):
    files = sorted(str(p) for p in POLICIES.glob("*.yaml"))
    assert main(["policy", "check", *files]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == len(files) == 5


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
