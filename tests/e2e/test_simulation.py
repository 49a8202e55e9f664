"""`fedciuic simulate` as a user runs it: a real simulation SuperLink and `flwr run`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedciuic.data import load_region_data
from fedciuic.demo_data import write_demo_corpora
from fedciuic.flower.launch import LocalFederation
from fedciuic.model import byte_tokenizer
from fedciuic.privacy import LEDGER_FILE, PrivacyLedger
from tests.conftest import ROOT
from tests.e2e.helpers import eval_loss, only_run, processes_under

pytestmark = pytest.mark.e2e


def simulate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fedciuic.cli",
            "simulate",
            "--app",
            str(ROOT),
            "--output-dir",
            str(tmp_path / "runs"),
            "--quiet",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )


def test_three_regions_two_rounds_eval_loss_falls_in_every_region(tmp_path):
    done = simulate(tmp_path, "--rounds", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    for region in ("eu", "cn", "us"):
        assert eval_loss(data, 2, region) < eval_loss(data, 0, region), region
        for server_round in ("1", "2"):
            assert data["rounds"][server_round]["train"][region]["status"] == "trained"
        assert f"\n{region} " in done.stdout  # the summary has a line per region
    run_dir = Path(data["run"]["output_dir"])
    assert (run_dir / "adapter" / "adapter_model.safetensors").stat().st_size > 0
    assert (run_dir / "summary.txt").exists()
    assert not processes_under(tmp_path), "simulate left Flower processes running"
    # Every party's audit log verifies, and the regions' logs agree with the aggregator's.
    assert done.stdout.count("audit: OK: ") == 4, done.stdout
    (report,) = run_dir.glob("compliance-report-run-*.md")
    text = report.read_text()
    assert "The region and aggregator logs agree." in text
    transfers = [
        line
        for line in text.splitlines()
        if re.fullmatch(r"\| [12] \| (eu|cn|us) \| aggregator \(EU\) \|.*\| yes \|", line)
    ]
    assert len(transfers) == 6, text  # 3 regions x 2 rounds, each received as sent
    (workdir,) = (tmp_path / "runs" / ".flower").iterdir()
    keys = workdir / "keys"
    verified = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedciuic.cli",
            "audit",
            "verify",
            str(workdir / "audit" / "aggregator.audit.jsonl"),
            "--pubkey",
            str(keys / "aggregator.pub.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0 and verified.stdout.startswith("OK: "), verified.stdout


def test_a_region_whose_budget_is_spent_declines_and_the_run_completes(tmp_path):
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu", "cn", "us"))
    eu = load_region_data(
        "eu",
        data_root / "eu",
        byte_tokenizer(),
        seq_len=64,
        eval_fraction=0.1,
        max_eval_examples=128,
    )
    ledger_path = data_root / "eu" / ".fedciuic" / LEDGER_FILE
    ledger = PrivacyLedger.open(
        ledger_path, region="eu", dataset=eu.fingerprint, delta=1e-5, accountant="prv"
    )
    step = (0.5, 0.01, 500)  # an earlier run that spent the whole budget
    ledger.append(
        ledger.new_record(
            run_id=1,
            server_round=1,
            step=step,
            max_grad_norm=1.0,
            secure_mode=False,
            epsilon=ledger.epsilon_after(step),
        )
    )
    spent = ledger_path.read_text()

    done = simulate(tmp_path, "--rounds", "2", "--data-root", str(data_root))
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    for server_round in ("1", "2"):
        train = data["rounds"][server_round]["train"]
        assert train["eu"]["status"] == "declined"
        assert "over its budget 8 (epsilon-budget)" in train["eu"]["reason"]
        assert train["cn"]["status"] == train["us"]["status"] == "trained"
        assert sorted(data["rounds"][server_round]["aggregate"]["regions"]) == ["cn", "us"]
    assert ledger_path.read_text() == spent  # nothing more was spent
    assert "declined x2" in done.stdout


def test_a_region_without_data_declines_and_the_others_train(tmp_path):
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu", "cn"))
    (data_root / "us").mkdir()
    done = simulate(tmp_path, "--rounds", "1", "--data-root", str(data_root))
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    train = data["rounds"]["1"]["train"]
    assert train["us"]["status"] == "declined"
    assert "holds no .jsonl or .txt files" in train["us"]["reason"]
    assert train["eu"]["status"] == train["cn"]["status"] == "trained"
    assert sorted(data["rounds"]["1"]["aggregate"]["regions"]) == ["cn", "eu"]
    assert not processes_under(tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run-config", "model-preset='huge'"], "model-preset: unknown preset 'huge'"),
        (
            ["--run-config", "model-path='/no/such/ckpt'"],
            "model-path: /no/such/ckpt is not a directory",
        ),
        (["--run-config", "lerning-rate=0.1"], "--run-config:lerning-rate: unknown key"),
        (["--regions", "eu,xx"], "region xx (simulated regions are named after their"),
        (["--run-config", "keys-dir='/no/keys'"], "/no/keys/aggregator.key.json: no private key"),
        (["--run-config", "aggregator-jurisdiction='XX'"], "unknown jurisdiction 'XX'"),
        (["--run-config", "policies-dir='/no/policies'"], "/no/policies: no such folder"),
    ],
)
def test_bad_run_config_stops_before_any_process_starts(tmp_path, args, message):
    done = simulate(tmp_path, *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs" / ".flower").exists()


def test_a_malformed_policy_stops_the_simulation_before_it_starts(tmp_path):
    policies = tmp_path / "policies"
    policies.mkdir()
    for name in ("eu-gdpr.yaml", "us-ccpa.yaml"):
        (policies / name).write_text((ROOT / "policies" / name).read_text())
    (policies / "cn-pipl.yaml").write_text("version: 1\njurisdiction: CN\nlaws: [PIPL]\n")
    done = simulate(tmp_path, "--run-config", f"policies-dir='{policies}'")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no valid policy for jurisdiction CN" in done.stderr
    assert f"{policies / 'cn-pipl.yaml'}:1: transfers: Field required" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / ".flower").exists()


def test_the_refusal_example_shows_cn_declining_a_us_aggregator(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "policy_refusal.py"),
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  - aggregator in US, CN's policy allows CN, EU" in done.stdout
    assert "  - relay in US, a third country for CN" in done.stdout
    data = only_run(tmp_path)
    train = data["rounds"]["1"]["train"]
    assert train["cn"]["status"] == "declined"
    assert train["eu"]["status"] == train["us"]["status"] == "trained"
    assert data["rounds"]["1"]["aggregate"] == {"published": True, "regions": ["eu", "us"]}
    assert not processes_under(tmp_path)


def test_serverapp_stops_with_one_line_on_a_model_path_that_is_not_a_checkpoint(tmp_path):
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=True)
        _, log = federation.run_app(
            {"output-dir": str(out), "model-path": str(tmp_path / "nope")},
            federation_config={"num-supernodes": 3, "client-resources-num-cpus": 1},
            timeout=600,
        )
    assert f"fedciuic: run config:model-path: {tmp_path / 'nope'} is not a directory" in log
    assert "Traceback" not in log
    data = only_run(out)
    assert data["run"]["status"] == "failed" and data["rounds"] == {}
