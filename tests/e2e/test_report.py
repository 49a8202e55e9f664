"""The demo as a person follows it: `fedciuic simulate` prints each round, `fedciuic report`
writes a page with plots that a real browser renders.

One simulation (eu, cn, us; the aggregator in the US, so CN's policy declines every
round) is shared by the tests of this module.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from fedciuic.audit.log import load_records
from tests.conftest import ROOT, record_level_policies
from tests.e2e import pace
from tests.e2e.helpers import built_once, only_run, processes_under
from tests.e2e.pace import patient

pytestmark = pytest.mark.e2e

ROUNDS = 2
ARTIFACTS = ROOT / "test-artifacts"


def fedciuic(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedciuic.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=patient(timeout),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    return built_once("report-demo", _demo)


def _demo(tmp: Path) -> dict[str, Any]:
    pace.calibrate()  # before any test's own: this fixture's waits come first
    done = fedciuic(
        "simulate",
        "--app",
        str(ROOT),
        "--output-dir",
        str(tmp / "runs"),
        "--rounds",
        str(ROUNDS),
        "--run-config",
        "local-steps=5",
        "--run-config",
        "aggregator-jurisdiction='US'",
        "--run-config",  # the run is record-level: lab copies of the shipped policies
        f"policies-dir='{record_level_policies(tmp / 'policies')}'",
        cwd=tmp,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not processes_under(tmp), "simulate left Flower processes running"
    data = only_run(tmp / "runs")
    (workdir,) = (tmp / "runs" / ".flower").iterdir()
    return {"tmp": tmp, "stdout": done.stdout, "data": data, "workdir": workdir}


def refusals_in_the_logs(workdir: Path, run_id: int) -> set[tuple[int, str, str]]:
    """(round, region, reason) of every refusal either side logged in this run."""
    found = set()
    for log in [
        workdir / "audit" / "aggregator.audit.jsonl",
        *workdir.glob("demo-data/*/.fedciuic/audit.jsonl"),
    ]:
        for r in load_records(log):
            if r["run_id"] == run_id and r["event"] in (
                "declined",
                "region_declined",
                "update_rejected",
            ):
                region = r["details"].get("region", r["actor"])
                found.add((int(r["round"]), region, r["details"]["reason"]))
    return found


def test_simulate_prints_each_round_as_plain_lines_in_a_log(demo):
    out = demo["stdout"]
    assert "\r" not in out and "\033" not in out  # stdout is a pipe: no live line
    run_id = demo["data"]["run"]["run_id"]
    assert f"run {run_id} started" in out
    assert "regions eu, cn, us; 2 round(s); DP on" in out
    assert re.search(r"^round 0/2 initial adapter \([\d.]+ s\): eval loss  eu [\d.]+", out, re.M)
    for number in range(1, ROUNDS + 1):
        block = out.split(f"round {number}/{ROUNDS} (", 1)[1].split("\n  overall", 1)[0]
        assert "aggregate published from eu, us" in block
        # no train loss: a run whose figures are all DP keeps it home (docs/privacy.md)
        assert re.search(r"^  eu +trained +- +[\d.]+  [\d.]+ of 8 per user +\d+ B$", block, re.M)
        assert re.search(r"^  cn +declined .*CN's policy allows CN, EU", block, re.M)
    assert f"run {run_id} completed after" in out
    assert f"run report: {demo['data']['run']['output_dir']}/report.html" in out


def test_report_lists_every_region_and_every_refusal_with_the_plots(demo):
    run_dir = Path(demo["data"]["run"]["output_dir"])
    page = demo["tmp"] / "page" / "report.html"
    done = fedciuic("report", str(run_dir), "--out", str(page), cwd=demo["tmp"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"report: {page}\n")
    text = html.unescape(page.read_text())
    for region in ("eu", "cn", "us"):
        assert f"<td>{region}</td>" in text
    refusals = refusals_in_the_logs(demo["workdir"], demo["data"]["run"]["run_id"])
    assert {(r, region) for r, region, _ in refusals} == {(0, "cn"), (1, "cn"), (2, "cn")}
    for number, region, reason in refusals:
        row = f"<td>{number}</td><td>{region}</td><td>declined</td><td>{reason}</td>"
        assert row in text, row
    # Self-contained: every picture is inline, nothing is fetched.
    assert not re.search(r"""(src|href)=["'](?!data:)""", text)
    assert text.count('src="data:image/png;base64,') == 4
    # The plots, as PNG files, with the numbers they draw.
    values = json.loads((page.parent / "report" / "series.json").read_text())
    assert set(values["eval_loss"]) == {"eu", "us", "overall"}  # cn never evaluated
    assert [x for x, _ in values["eval_loss"]["eu"]] == [0, 1, 2]
    assert set(values["epsilon"]) == {"eu", "us"} and values["epsilon_budget"] == {"eu": 8, "us": 8}
    assert all(0 < eps <= 8 for points in values["epsilon"].values() for _, eps in points)
    assert {r: [x for x, _ in p] for r, p in values["upload_bytes"].items()} == {
        "eu": [1, 2],
        "us": [1, 2],
    }
    outcomes = {(d["round"], d["subject"], d["outcome"]) for d in values["decisions"]}
    assert {(1, "aggregate", "published"), (2, "eu", "accepted"), (2, "cn", "declined")} <= outcomes
    for name in ("eval_loss", "epsilon", "upload_bytes", "decisions"):
        with Image.open(page.parent / "report" / f"{name}.png") as image:
            assert image.format == "PNG" and image.width >= 600


def test_the_report_renders_in_headless_chromium(demo, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: bash scripts/setup-browser.sh installs it"
    page = Path(demo["data"]["run"]["output_dir"]) / "report.html"  # written by simulate
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report-screenshot.png"
    shot.unlink(missing_ok=True)
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == (1200, 2400)
        pixels = list(image.convert("RGB").getdata())

    # eu's and us's lines and bars (matplotlib's C0 blue, C2 green) only come from the
    # embedded plots: the browser decoded and drew them.
    def near(colour: tuple[int, int, int]) -> int:
        return sum(all(abs(p[i] - colour[i]) < 30 for i in range(3)) for p in pixels)

    assert near((31, 119, 180)) > 2000 and near((44, 160, 44)) > 2000
    # And the text: the page is mostly white with dark type, not a blank or error page.
    assert sum(p == (255, 255, 255) for p in pixels) > len(pixels) // 2


def test_report_flags_an_audit_log_that_was_tampered_with(demo):
    workdir, tmp = demo["workdir"], demo["tmp"]
    forged = tmp / "forged" / "aggregator.audit.jsonl"
    forged.parent.mkdir()
    text = (workdir / "audit" / "aggregator.audit.jsonl").read_text()
    assert '"region":"us"' in text
    forged.write_text(text.replace('"region":"us"', '"region":"eu"', 1))  # credit us's update to eu
    run_dir = Path(demo["data"]["run"]["output_dir"])
    page = tmp / "forged" / "report.html"
    done = fedciuic(
        "report",
        str(run_dir),
        "--audit-log",
        str(forged),
        "--keys",
        str(workdir / "keys"),
        "--out",
        str(page),
        cwd=tmp,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"audit: FAIL: {forged}" in done.stderr
    assert "An audit log FAILED verification" in page.read_text()
