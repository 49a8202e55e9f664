"""`fedciuic report`: bad input, the decision timeline and the plots' series, without Flower."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic.audit.log import AuditLog
from fedciuic.audit.report import PartyLog
from fedciuic.crypto.keys import load_keypair
from fedciuic.errors import EXIT_AUDIT, EXIT_NO_AGGREGATE, EXIT_OK, EXIT_UNFINISHED
from fedciuic.ops.cli import main
from fedciuic.ops.run_report import (
    decisions,
    figures,
    series,
)
from fedciuic.record.metrics import RunMetrics
from tests.ops.test_cli import small_federation


def record(seq: int, actor: str, event: str, rnd: int | None, **details: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "actor": actor,
        "event": event,
        "round": rnd,
        "run_id": 9,
        "details": details,
    }


def test_a_missing_or_damaged_run_folder_is_one_line_naming_the_file(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "nope: no such folder; pass a run folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path}/metrics.json: not found; {tmp_path} is not a run folder" in (
        capsys.readouterr().err
    )
    (tmp_path / "metrics.json").write_text('{"run": {"run_id": 1}, "rounds": {')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.json: not valid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "report.html").exists()


def test_a_run_without_its_audit_log_asks_for_it(tmp_path, capsys):
    gone = tmp_path / "audit" / "aggregator.audit.jsonl"
    (tmp_path / "metrics.json").write_text(
        json.dumps(
            {
                "run": {"run_id": 1, "status": "completed", "audit_log": str(gone), "config": {}},
                "rounds": {},
            }
        )
    )
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{gone}: the aggregator's audit log is not there; pass --audit-log PATH" in err
    assert main(["report", str(tmp_path), "--audit-log", str(gone)]) == 2
    assert f"--audit-log {gone}: no such file" in capsys.readouterr().err


def test_a_run_that_failed_before_its_audit_log_is_reported_from_what_there_is(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text(
        json.dumps(
            {
                "run": {"run_id": 1, "status": "interrupted", "error": "SIGTERM", "config": {}},
                "rounds": {},
            }
        )
    )
    assert main(["report", str(tmp_path)]) == EXIT_UNFINISHED
    out = capsys.readouterr().out
    assert "note: This run did not end (interrupted: SIGTERM)" in out
    assert "note: No audit log to read" in out
    page = (tmp_path / "report.html").read_text()
    assert "<b>interrupted</b>" in page and "No audit log to read" in page


def _run_with_logs(tmp_path: Path, status: str, *, keys: bool = True) -> list[str]:
    """small_federation's logs (run 9) and a run folder whose metrics.json says
    ``status``; the `fedciuic report` arguments for it."""
    folder, _ = small_federation(tmp_path / "logs")
    run_dir = tmp_path / "run-9"
    run_dir.mkdir()
    run = {"run_id": 9, "status": status, "regions": ["eu", "cn"], "config": {}}
    (run_dir / "metrics.json").write_text(json.dumps({"run": run, "rounds": {}}))
    logs = [folder / name for name in ("aggregator.audit.jsonl", "eu.jsonl", "cn.jsonl")]
    args = [str(run_dir), *(f"--audit-log={log}" for log in logs)]
    return [*args, f"--keys={folder / 'keys'}"] if keys else args


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("completed", EXIT_OK),
        ("no-aggregate", EXIT_NO_AGGREGATE),
        ("interrupted", EXIT_UNFINISHED),
        ("failed", EXIT_UNFINISHED),
        ("running", EXIT_UNFINISHED),
    ],
)
def test_report_exits_0_only_for_a_completed_run_whose_logs_all_verify(
    tmp_path, capsys, status, code
):
    assert main(["report", *_run_with_logs(tmp_path, status)]) == code
    assert capsys.readouterr().out.count("audit: OK: ") == 3


def test_report_of_an_interrupted_run_with_an_unsigned_tail_exits_4_not_0(tmp_path, capsys):
    """The writer stopped before signing its last records: FAIL, and not a success."""
    args = _run_with_logs(tmp_path, "interrupted")
    folder = tmp_path / "logs"
    key = load_keypair(folder / "keys" / "aggregator.key.json")
    log = AuditLog(folder / "aggregator.audit.jsonl", "aggregator", key)
    log.append("round_start", run_id=9, server_round=2)  # no checkpoint covers it
    log.close()
    assert main(["report", *args]) == EXIT_UNFINISHED
    assert "audit: (the run did not end; its tail is unverified) FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("status", ["completed", "interrupted"])
def test_report_exits_1_for_a_log_that_fails_or_cannot_be_verified(tmp_path, capsys, status):
    assert main(["report", *_run_with_logs(tmp_path, status, keys=False)]) == EXIT_AUDIT
    assert "audit logs: not verified (no public keys; pass --keys DIR)" in capsys.readouterr().out
    args = _run_with_logs(tmp_path / "forged", status)
    eu = tmp_path / "forged" / "logs" / "eu.jsonl"
    eu.write_text(eu.read_text().replace('"epsilon":4.0', '"epsilon":0.4'))
    assert main(["report", *args]) == EXIT_AUDIT
    assert f"audit: FAIL: {eu}" in capsys.readouterr().err


def test_report_help_lists_its_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    for code in (EXIT_OK, EXIT_AUDIT, 2, EXIT_NO_AGGREGATE, EXIT_UNFINISHED):
        assert f"\n  {code}  " in out.split("exit status:", 1)[1]


def test_the_timeline_has_every_refusal_once_from_either_side():
    aggregator = PartyLog(
        Path("aggregator.audit.jsonl"),
        "aggregator",
        [
            record(0, "aggregator", "run_start", None, regions=["eu", "cn", "us"]),
            record(1, "aggregator", "update_accepted", 1, region="eu"),
            record(2, "aggregator", "update_rejected", 1, region="us", reason="norm 90 > 50"),
            record(3, "aggregator", "region_declined", 1, region="cn", reason="aggregator in US"),
            record(4, "aggregator", "aggregate_withheld", 1, reasons=["needs 2 regions"]),
            record(5, "aggregator", "reply_failed", 2, region="us", reason="no reply"),
            record(6, "aggregator", "aggregate_published", 2, regions=["eu"]),
            {**record(7, "aggregator", "update_accepted", 1, region="eu"), "run_id": 8},
        ],
    )
    cn = PartyLog(
        Path("cn.jsonl"),
        "cn",
        [
            record(0, "cn", "declined", 0, reason="aggregator in US"),  # evaluation, round 0
            record(1, "cn", "declined", 1, reason="aggregator in US"),  # the aggregator has it
            record(2, "cn", "declined", 1, reason="aggregator in US"),  # its evaluation
        ],
    )
    found = [(d.round, d.subject, d.outcome, d.reason) for d in decisions([aggregator, cn], 9)]
    assert found == [
        (0, "cn", "declined", "aggregator in US"),
        (1, "cn", "declined", "aggregator in US"),
        (1, "eu", "accepted", ""),
        (1, "us", "rejected", "norm 90 > 50"),
        (1, "aggregate", "withheld", "needs 2 regions"),
        (2, "us", "failed", "no reply"),
        (2, "aggregate", "published", "from eu"),
    ]


def test_each_plot_draws_the_series_it_is_named_after():
    data = {
        "run": {"run_id": 9, "status": "completed", "regions": ["eu", "cn"]},
        "rounds": {
            "0": {"eval": {"eu": {"loss": 5.0}, "cn": {"loss": 5.2}, "overall": {"loss": 5.1}}},
            "1": {
                "eval": {"eu": {"loss": 4.0}, "cn": {"loss": 4.2}, "overall": {"loss": 4.1}},
                "train": {
                    "eu": {
                        "status": "trained",
                        "epsilon": 3.0,
                        "epsilon_budget": 8.0,
                        "upload_bytes": 2000,
                    },
                    "cn": {
                        "status": "trained",
                        "epsilon": 4.0,
                        "epsilon_budget": 6.0,
                        "upload_bytes": 2100,
                    },
                },
            },
        },
    }
    from fedciuic.ops.run_report import ReportedDecision

    values = series(
        RunMetrics.model_validate(data), [ReportedDecision(1, "cn", "declined", "why", "cn")]
    )
    assert values["eval_loss"]["cn"] == [[0, 5.2], [1, 4.2]]
    assert values["epsilon"] == {"eu": [[1, 3.0]], "cn": [[1, 4.0]]}
    assert values["epsilon_budget"] == {"eu": 8.0, "cn": 6.0}
    assert values["upload_bytes"] == {"eu": [[1, 2000]], "cn": [[1, 2100]]}
    drawn = figures(values)
    assert [line.get_label() for line in drawn["eval_loss"].axes[0].get_lines()] == [
        "eu",
        "cn",
        "overall (by examples)",
    ]
    labels = [line.get_label() for line in drawn["epsilon"].axes[0].get_lines()]
    assert labels == ["eu spent", "cn spent", "budget 6 (cn)", "budget 8 (eu)"]
    bars = drawn["upload_bytes"].axes[0].containers
    assert [c.get_label() for c in bars] == ["eu", "cn"]
    assert [round(b.get_height()) for b in bars[1]] == [2100]
    (declined,) = drawn["decisions"].axes[0].collections
    assert declined.get_label() == "declined"
    assert np.asarray(declined.get_offsets()).tolist() == [[1.0, 1.0]]  # round 1, the row of cn


def test_the_page_and_the_summary_name_what_each_epsilon_is_per():
    """eu declares user-level DP; cn's entry is from before units (record-level)."""
    from fedciuic.ops.outputs import summarize
    from fedciuic.ops.run_report import PLOTS, render

    data = RunMetrics.model_validate(
        {
            "run": {
                "run_id": 9,
                "status": "completed",
                "regions": ["eu", "cn"],
                "config": {"dp": True, "target-epsilon": 8.0, "privacy-unit": "user"},
            },
            "rounds": {
                "1": {
                    "train": {
                        "eu": {"status": "trained", "epsilon": 3.0, "epsilon_budget": 8.0},
                        "cn": {"status": "trained", "epsilon": 4.0, "epsilon_budget": 6.0},
                    }
                }
            },
        }
    )
    data.rounds[1].train["eu"].unit = "user"
    page = render(data, [], dict.fromkeys(PLOTS, b""), [], [], None)
    assert "target epsilon 8.0 per user" in page
    assert "<td>3.00 of 8 per user</td>" in page and "<td>4.00 of 6 per record</td>" in page
    summary = summarize(data)
    assert "target epsilon 8.0 per user" in summary
    assert "3.00 of 8 per user" in summary and "4.00 of 6 per record" in summary


def test_the_page_and_the_summary_show_each_regions_steps_per_round():
    """A local-time-budget gives regions different step counts: both outputs show them."""
    from fedciuic.ops.outputs import summarize
    from fedciuic.ops.run_report import PLOTS, render

    def trained(steps: int) -> dict[str, Any]:
        return {"status": "trained", "steps": steps}

    data = RunMetrics.model_validate(
        {
            "run": {"run_id": 9, "status": "completed", "regions": ["eu", "us"], "config": {}},
            "rounds": {
                "1": {"train": {"eu": trained(30), "us": trained(8)}},
                "2": {"train": {"eu": trained(30), "us": {"status": "failed"}}},
                "3": {"train": {"eu": trained(29), "us": trained(7)}},
            },
        }
    )
    page = render(data, [], dict.fromkeys(PLOTS, b""), [], [], None)
    assert "<th>local steps per round</th>" in page
    assert "<td>30/30/29</td>" in page and "<td>8/7</td>" in page
    lines = {line.split()[0]: line for line in summarize(data).splitlines()[1:4]}
    assert "steps/round" in lines["region"]
    assert "30/30/29" in lines["eu"] and "8/7" in lines["us"]


def _three_regions(epsilons: dict[str, float]) -> dict[str, Any]:
    """Series of three regions: eval loss and epsilon per round, as ``epsilons`` scales."""
    from fedciuic.ops.run_report import series

    regions = list(epsilons)
    rounds: dict[str, Any] = {}
    for n in (1, 2, 3):
        rounds[str(n)] = {
            "eval": {r: {"loss": 5.0 - n} for r in regions},
            "train": {
                r: {"status": "trained", "epsilon": e * n, "epsilon_budget": 8.0}
                for r, e in epsilons.items()
            },
        }
    data = {"run": {"run_id": 9, "status": "completed", "regions": regions}, "rounds": rounds}
    return series(RunMetrics.model_validate(data), [])


def test_identical_epsilon_curves_still_show_and_name_every_region():
    """Same data size and settings give three identical curves: each region keeps its
    own legend entry, marker and dash, none is moved off its true values, and the
    legend and the caption say they coincide."""
    from fedciuic.ops.run_report import curve_notes

    values = _three_regions({"eu": 1.0, "cn": 1.0, "us": 1.0})
    drawn = figures(values)
    ax = drawn["epsilon"].axes[0]
    curves = [
        line for line in ax.get_lines() if str(line.get_label()).split()[0] in values["regions"]
    ]
    assert [line.get_label() for line in curves] == [
        "eu spent (identical to cn, us)",
        "cn spent (identical to eu, us)",
        "us spent (identical to eu, cn)",
    ]
    legend = ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()][:3] == [c.get_label() for c in curves]
    assert len({(c.get_marker(), str(c.get_linestyle()), c.get_color()) for c in curves}) == 3
    assert all(np.asarray(c.get_ydata()).tolist() == [1.0, 2.0, 3.0] for c in curves)  # true
    sizes = [c.get_markersize() for c in curves]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3  # nested
    assert all(c.get_markerfacecolor() == "none" for c in curves)
    loss = [line.get_label() for line in drawn["eval_loss"].axes[0].get_lines()]
    assert loss == [
        "eu (identical to cn, us)",
        "cn (identical to eu, us)",
        "us (identical to eu, cn)",
    ]
    notes = curve_notes(values)
    assert notes["epsilon"].startswith("eu, cn, us: identical curves")
    assert "eval_loss" in notes


def test_curves_that_differ_are_labelled_by_region_alone():
    from fedciuic.ops.run_report import curve_notes

    values = _three_regions({"eu": 1.0, "cn": 1.0, "us": 2.0})
    labels = [line.get_label() for line in figures(values)["epsilon"].axes[0].get_lines()]
    assert labels[:3] == ["eu spent (identical to cn)", "cn spent (identical to eu)", "us spent"]
    assert curve_notes(values)["epsilon"].startswith("eu, cn: identical curves")
    assert "epsilon" not in curve_notes(_three_regions({"eu": 1.0, "cn": 2.0, "us": 3.0}))


def test_the_page_caption_says_which_curves_coincide():
    from fedciuic.ops.run_report import PLOTS, render

    data = {
        "run": {"run_id": 9, "status": "completed", "regions": ["eu", "cn"], "config": {}},
        "rounds": {
            "1": {
                "train": {
                    r: {"status": "trained", "epsilon": 2.0, "epsilon_budget": 8.0}
                    for r in ("eu", "cn")
                }
            }
        },
    }
    page = render(RunMetrics.model_validate(data), [], dict.fromkeys(PLOTS, b""), [], [], None)
    assert "eu, cn: identical curves, drawn over one another" in page


def test_report_writes_the_compliance_report_as_simulate_does(tmp_path, capsys):
    """start.sh ends with `fedciuic report RUN_DIR --keys ...`: the deployment gets the
    same compliance report file as a simulation, in the run folder."""
    args = _run_with_logs(tmp_path, "completed")
    assert main(["report", *args]) == EXIT_OK
    run_dir = tmp_path / "run-9"
    md = run_dir / "compliance-report-run-9.md"
    assert f"compliance report: {md} (and .html)" in capsys.readouterr().out
    text = md.read_text()
    for title in (
        "Run",
        "Audit logs examined",
        "Regions",
        "Transfers",
        "Refusals",
        "Agreement between the logs",
        "Record of processing and cross-border transfers",
    ):
        assert f"\n## {title}\n" in text
    assert (run_dir / "compliance-report-run-9.html").read_text().startswith("<!doctype html>")


def test_the_page_and_the_compliance_report_show_no_local_path(tmp_path, capsys):
    """The aggregator's policy (EU) redacts paths: neither the page nor the compliance
    report names where the run, its logs or keys sit, not even in a failure's text."""
    args = _run_with_logs(tmp_path, "failed")
    run_dir = tmp_path / "run-9"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["run"].update(
        output_dir=str(tmp_path),
        error=f"FileNotFoundError: {tmp_path}/adapters/missing.safetensors",
    )
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    key = load_keypair(tmp_path / "logs" / "keys" / "aggregator.key.json")
    log = AuditLog(tmp_path / "logs" / "aggregator.audit.jsonl", "aggregator", key)
    log.append("round_start", run_id=9, server_round=2)  # unsigned: a note naming the log
    log.close()
    main(["report", *args])
    capsys.readouterr()
    page = (run_dir / "report.html").read_text()
    assert "missing.safetensors" in page and "aggregator.audit.jsonl" in page
    for written in (
        page,
        (run_dir / "compliance-report-run-9.md").read_text(),
        (run_dir / "compliance-report-run-9.html").read_text(),
        (run_dir / "report" / "series.json").read_text(),
    ):
        assert str(tmp_path) not in written


def test_a_policy_that_allows_paths_lets_the_page_show_them(tmp_path, capsys):
    from fedciuic.policy.rules import load_policy
    from tests.conftest import ROOT

    us = load_policy(ROOT / "policies" / "us-ccpa.yaml")  # audit.redact_paths: false
    args = _run_with_logs(tmp_path, "completed")
    run_dir = tmp_path / "run-9"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["run"]["output_dir"] = str(tmp_path)
    metrics["run"]["config"]["aggregator-jurisdiction"] = "US"
    metrics["run"]["policies"] = {"US": {"file": str(us.path), "hash": us.hash}}
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    main(["report", *args])
    capsys.readouterr()
    assert f"from {tmp_path}." in (run_dir / "report.html").read_text()
    metrics["run"]["policies"]["US"]["hash"] = "0" * 64  # not the policy the run held
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    main(["report", *args])
    capsys.readouterr()
    assert str(tmp_path) not in (run_dir / "report.html").read_text()
