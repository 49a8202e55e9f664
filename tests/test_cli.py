"""The `fedciuic` command's non-simulation subcommands, called as a user would."""

from __future__ import annotations

import json
import stat

from fedciuic.cli import main


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
