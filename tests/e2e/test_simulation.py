"""`fedciuic simulate` as a user runs it: a real simulation SuperLink and `flwr run`."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fedciuic.audit import REGION_LOG, Event, load_records
from fedciuic.config import COUNTS, EVALUATION, TRAINING, RunConfig
from fedciuic.data.corpus import region_fingerprint
from fedciuic.data.demo import DOCS_FILE, INSTRUCTIONS_FILE, write_demo_corpora
from fedciuic.errors import EXIT_UNFINISHED
from fedciuic.flower.launch import LocalFederation
from fedciuic.model.adapter import AdapterLayout
from fedciuic.ops import cli
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger
from fedciuic.releases import WITHHELD_REASON
from tests.conftest import ROOT, app_config, record_level_policies
from tests.e2e.helpers import describe, eval_loss, only_run, processes_under, stop_everything
from tests.e2e.pace import patient
from tests.region.test_each_family import TARGETS

pytestmark = pytest.mark.e2e
#: For a test of who trains and what is recorded, not of what is learnt: 2 DP steps a
#: round instead of the app's 30 (the first test keeps them, to see the loss fall).
FEW_STEPS = ("--run-config", "local-steps=2")


def _command(tmp_path: Path, *args: str) -> list[str]:
    """``fedciuic simulate`` (:func:`_arguments`) as a process."""
    return [sys.executable, "-m", "fedciuic.ops.cli", *_arguments(tmp_path, *args)]


def _arguments(tmp_path: Path, *args: str) -> list[str]:
    """``fedciuic``'s arguments to simulate under record-level lab copies of the shipped
    policies (the runs are record-level); a policies-dir in ``args`` comes later and wins."""
    lab = record_level_policies(tmp_path / "lab-policies")
    return [
        "simulate",
        "--app",
        str(ROOT),
        "--output-dir",
        str(tmp_path / "runs"),
        "--quiet",
        "--run-config",
        f"policies-dir='{lab}'",
        *args,
    ]


def exact_releases(tmp_path: Path, *keys: str) -> tuple[str, ...]:
    """Arguments for a run whose ``keys`` (count-noise, eval-noise) are 0, under lab
    policies that let the exact figures out (privacy.releases: any)."""
    lab = record_level_policies(tmp_path / "lab-exact", privacy__releases="any")
    args = [arg for key in keys for arg in ("--run-config", f"{key}=0")]
    return (*args, "--run-config", f"policies-dir='{lab}'")


def simulate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(tmp_path, *args),
        capture_output=True,
        text=True,
        timeout=patient(900),
        cwd=tmp_path,
    )


def test_three_regions_two_rounds_eval_loss_falls_in_every_region(tmp_path):
    """Exact held-out losses (eval-noise = 0, under lab policies that let them out): a DP
    one over the demo's few held-out units is too noisy to show learning (docs/privacy.md;
    the shipped policies' run is the next test's)."""
    done = simulate(tmp_path, "--rounds", "2", *exact_releases(tmp_path, "eval-noise"))
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
    # Nothing it started is left: Flower's processes, Ray's GCS, raylet and
    # ClientAppActor workers (found by the mark they inherit, wherever re-parented).
    left = processes_under(tmp_path)
    assert not left, "simulate left processes running:\n" + describe(left)
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
    # Each region scrubbed the demo's synthetic identifiers before each round it trained
    # (the shipped CN and EU policies require it), counted per entity type, no value.
    scrubbed = [
        line
        for line in text.splitlines()
        if re.fullmatch(r"\| [12] \| (eu|cn|us) \| [0-9a-f]{12} \| placeholder \|.*\|", line)
        and "DICTIONARY" in line
        and "EMAIL_ADDRESS" in line
    ]
    assert len(scrubbed) == 6, text
    assert "@example.org" not in text
    (workdir,) = (tmp_path / "runs" / ".flower").iterdir()
    keys = workdir / "keys"
    verified = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedciuic.ops.cli",
            "audit",
            "verify",
            str(workdir / "audit" / "aggregator.audit.jsonl"),
            "--pubkey",
            str(keys / "aggregator.pub.json"),
        ],
        capture_output=True,
        text=True,
        timeout=patient(120),
    )
    assert verified.returncode == 0 and verified.stdout.startswith("OK: "), verified.stdout


def test_two_regions_train_on_chat_data_per_user_under_the_shipped_policies(
    tmp_path, tiny_checkpoints
):
    """Chat records only, privacy-unit = "user", the shipped EU policy (which requires
    it), on R1-0528-Qwen3-8B's architecture loaded from its checkpoint folder (its own BPE
    tokenizer and chat template): both regions train, and the ledger, metrics and both
    reports name the unit."""
    path = tiny_checkpoints["qwen3"]
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu", "cn"))
    for region in ("eu", "cn"):
        for name in (DOCS_FILE, INSTRUCTIONS_FILE):
            (data_root / region / name).unlink()
    done = simulate(
        tmp_path,
        "--rounds",
        "1",
        "--regions",
        "eu,cn",
        "--data-root",
        str(data_root),
        "--run-config",
        "privacy-unit='user'",
        *FEW_STEPS,
        "--run-config",
        f"model-path='{path}'",
        "--run-config",
        f"policies-dir='{ROOT / 'policies'}'",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    for region in ("eu", "cn"):
        entry = data["rounds"]["1"]["train"][region]
        assert entry["status"] == "trained" and entry["unit"] == "user", entry
        header = json.loads(
            (data_root / region / ".fedciuic" / LEDGER_FILE).read_text().split("\n")[0]
        )
        assert header["unit"] == "user"
        assert f"\n{region} " in done.stdout and "per user" in done.stdout
        # The shipped policies let out only DP releases: a DP count, DP evaluations, and
        # neither the training loss nor the step time.
        assert entry.get("loss") is None and entry["num_examples"] > 0
        ledger = PrivacyLedger.load(data_root / region / ".fedciuic" / LEDGER_FILE)
        assert {r.purpose for r in ledger.rounds} == {COUNTS, EVALUATION, TRAINING}
        evaluated = data["rounds"]["1"]["eval"][region]
        assert evaluated["status"] == "evaluated" and evaluated.get("step_seconds") is None
    assert_trained_from(data, path, "qwen3")
    run_dir = Path(data["run"]["output_dir"])
    (report,) = run_dir.glob("compliance-report-run-*.md")
    text = report.read_text()
    assert "per user" in text
    assert "per user" in (run_dir / "report.html").read_text()
    # Nothing of either region's data left outside DP, and the report says so.
    outside = text.split("Figures sent outside DP", 1)[1].split("\n#", 1)[0]
    assert "None: each region's own log records sending only DP releases" in outside, outside
    assert not processes_under(tmp_path)


def _spent_ledger(data_root: Path, region: str) -> Path:
    """``region``'s ledger with an earlier run that spent its whole budget."""
    path = data_root / region / ".fedciuic" / LEDGER_FILE
    ledger = PrivacyLedger.open(
        path,
        region=region,
        dataset=region_fingerprint(data_root / region),
        delta=1e-5,
        accountant="prv",
        unit=app_config()["privacy-unit"],
    )
    step = (0.5, 0.01, 500)
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
    return path


def test_regions_with_a_spent_budget_no_data_or_a_damaged_ledger_decline_and_others_train(
    tmp_path, tiny_checkpoints
):
    """Each region's fault stays in that region: eu's budget was spent by an earlier run,
    us holds no data, sg's ledger is damaged. The launcher's budget preview says so per
    region before anything starts; each declines every round with its reason and spends
    nothing; cn and in train both rounds, on DeepSeek-V4 loaded from its checkpoint
    folder (its own BPE tokenizer and chat template) through Flower."""
    regions = ("eu", "cn", "us", "sg", "in")
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu", "cn", "sg", "in"))
    (data_root / "us").mkdir()
    ledger_path = _spent_ledger(data_root, "eu")
    spent = ledger_path.read_text()
    damaged = data_root / "sg" / ".fedciuic" / LEDGER_FILE
    damaged.parent.mkdir()
    damaged.write_text('{"not": "a ledger header"}\n')
    # SG's and IN's shipped policies, as shipped, beside the lab copies of the others.
    policies = record_level_policies(tmp_path / "policies")
    for name in ("sg-pdpa.yaml", "in-dpdp.yaml"):
        (policies / name).write_text((ROOT / "policies" / name).read_text())
    path = tiny_checkpoints["deepseek_v4"]
    done = simulate(
        tmp_path,
        "--rounds",
        "2",
        "--regions",
        ",".join(regions),
        "--data-root",
        str(data_root),
        *FEW_STEPS,
        "--run-config",
        f"model-path='{path}'",
        "--run-config",
        f"policies-dir='{policies}'",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    reasons = {"eu": WITHHELD_REASON, "us": "holds no data files", "sg": f"{LEDGER_FILE}:1"}
    for server_round in ("1", "2"):
        train = data["rounds"][server_round]["train"]
        for region, reason in reasons.items():
            assert train[region]["status"] == "declined", (region, train[region])
            assert reason in train[region]["reason"], (region, train[region])
        # EU's policy is dp_only: its reason stays in its own log (below).
        assert train["eu"]["reason"] == WITHHELD_REASON
        for region in ("cn", "in"):
            assert train[region]["status"] == "trained" and train[region]["epsilon"] > 0
        assert sorted(data["rounds"][server_round]["aggregate"]["regions"]) == ["cn", "in"]
    assert_trained_from(data, path, "deepseek_v4")
    assert ledger_path.read_text() == spent  # nothing more was spent, not even a count
    said = [
        r["details"]["reason"]
        for r in load_records(data_root / "eu" / ".fedciuic" / REGION_LOG)
        if r["event"] == Event.DECLINED
    ]
    # two training rounds and three evaluations, each a release the budget refuses
    assert len(said) == 5 and all("budget 8" in reason for reason in said), said
    # ... and the launching machine said so before anything started, region by region.
    assert re.search(
        r"^budget: eu: a run at target-epsilon 4 \(\d+ steps\) would bring it to [\d.]+ of 8: "
        r"does not fit",
        done.stdout,
        re.M,
    ), done.stdout
    assert "budget: cn: nothing spent, budget 8" in done.stdout
    assert re.search(r"^budget: us: .*nothing spent", done.stdout, re.M), done.stdout
    assert re.search(rf"^budget: sg: .*{re.escape(LEDGER_FILE)}:1", done.stdout, re.M)
    assert "declined x2" in done.stdout
    assert not processes_under(tmp_path)


def assert_trained_from(data: dict[str, Any], path: Path, family: str) -> None:
    """The run's global adapter was trained on the checkpoint at ``path`` and covers its
    family's attention projections."""
    adapter = Path(data["run"]["output_dir"]) / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    adapted = {name.rsplit(".", 1)[-1] for name in config["target_modules"]}
    assert adapted == TARGETS[family]
    assert config["base_model_name_or_path"] == str(path)


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
        (["--cpus-per-region", "0"], "--cpus-per-region: 0: give 1 to"),
        (["--cpus-per-region", "9999"], "--cpus-per-region: 9999: give 1 to"),
    ],
)
def test_bad_run_config_stops_before_any_process_starts(tmp_path, capsys, args, message):
    """In this process (``fedciuic``'s own entry point): each case would start Python
    only to exit 2; the malformed policy's test below runs the command as a user does."""
    assert cli.main(_arguments(tmp_path, *args)) == 2
    stderr = capsys.readouterr().err
    assert message in stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1
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
        timeout=patient(900),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  - aggregator in US, CN's policy allows CN, EU" in done.stdout
    assert "  - relay in US, a third country for CN" in done.stdout
    data = only_run(tmp_path)
    train = data["rounds"]["1"]["train"]
    assert train["cn"]["status"] == "declined"
    assert train["eu"]["status"] == train["us"]["status"] == "trained"
    assert data["rounds"]["1"]["aggregate"] == {
        "published": True,
        "regions": ["eu", "us"],
        "version": 1,
    }
    assert not processes_under(tmp_path)


def test_serverapp_stops_with_one_line_on_a_model_path_that_is_not_a_checkpoint(tmp_path):
    out = tmp_path / "runs"
    with LocalFederation(tmp_path / "work", ROOT) as federation:
        federation.start_superlink(simulation=True)
        _, log = federation.run_app(
            {"output-dir": str(out), "model-path": str(tmp_path / "nope")},
            federation_config={"num-supernodes": 3, "client-resources-num-cpus": 1},
            timeout=patient(600),
        )
    assert f"fedciuic: run config:model-path: {tmp_path / 'nope'} is not a directory" in log
    assert "Traceback" not in log
    data = only_run(out)
    assert data["run"]["status"] == "failed" and data["rounds"] == {}


@pytest.mark.scenario
def test_second_simulate_on_same_data_root_verifies_and_a_spent_budget_exits_3(
    tmp_path, tiny_checkpoints
):
    """The documented way to continue ledgers: the same --data-root again. Each region's
    key is kept with its state, so its audit log, which outlives runs, verifies after
    every run; the second run is told before it starts what the first spent, and a
    target that no longer fits trains nothing and says so (exit 3, no adapter), instead
    of "completed" with an untrained adapter. Both runs load DeepSeek-V3.2 (its
    sparse-attention indexer) from its checkpoint folder."""
    data_root = tmp_path / "data"
    write_demo_corpora(data_root, ("eu", "us"))
    path = tiny_checkpoints["deepseek_v32"]
    common = (
        *("--regions", "eu,us", "--rounds", "1", "--data-root", str(data_root)),
        *("--run-config", f"model-path='{path}'"),
    )
    kept = data_root / "eu" / ".fedciuic" / "keys" / "eu.key.json"
    first = simulate(tmp_path, *common, "--run-config", "local-steps=2")  # the default target
    assert first.returncode == 0, f"{first.stdout}{first.stderr}"
    trained = only_run(tmp_path / "runs")
    for region in ("eu", "us"):
        entry = trained["rounds"]["1"]["train"][region]
        assert entry["status"] == "trained" and entry["epsilon"] > 0, entry
    assert_trained_from(trained, path, "deepseek_v32")
    assert first.stdout.count("audit: OK: ") == 3, first.stdout  # aggregator, eu, us
    assert "budget: eu: nothing spent, budget 8" in first.stdout
    key = kept.read_text()

    whole = ("--run-config", "local-steps=2", "--run-config", "target-epsilon=8.0")
    spent = simulate(tmp_path, *common, *whole)
    assert kept.read_text() == key  # the same key for both runs
    assert "signed by another key" not in spent.stdout
    assert re.search(
        r"^budget: eu: epsilon [\d.]+ of 8 spent per user \(delta 1e-05, \d+ "
        r"release\(s\) in 1 run\(s\): evaluation alone [\d.]+, counts alone [\d.]+, "
        r"training alone [\d.]+\), [\d.]+ left$",
        spent.stdout,
        re.M,
    ), spent.stdout
    assert "budget: eu: a run at target-epsilon 8 (2 steps) would bring it to " in spent.stdout
    assert ": does not fit (the region declines each round" in spent.stdout
    assert spent.returncode == 3, spent.stdout + spent.stderr
    assert spent.stdout.count("audit: OK: ") == 3, spent.stdout
    (newest,) = [
        p for p in (tmp_path / "runs").glob("run-*/metrics.json") if "no-aggregate" in p.read_text()
    ]
    data = json.loads(newest.read_text())
    assert data["run"]["status"] == "no-aggregate" and data["run"]["adapter"] is None
    assert not (newest.parent / "adapter").exists()
    for region in ("eu", "us"):
        assert data["rounds"]["1"]["train"][region]["status"] == "declined"
        assert any(
            line.startswith(f"{region}: declined in round 1: ") for line in data["run"]["reasons"]
        )
    assert "no-aggregate" in spent.stdout and "NO AGGREGATE: none was published" in spent.stdout
    assert "published no aggregate: nothing was trained (exit 3" in spent.stderr
    assert not processes_under(tmp_path)


@pytest.mark.scenario
def test_interrupted_run_is_marked_interrupted_and_reported(tmp_path):
    """SIGTERM to `fedciuic simulate` mid-run: every process goes, metrics.json says
    interrupted (not "running" forever), and `fedciuic report` describes what is there."""
    runs = tmp_path / "runs"
    process = subprocess.Popen(
        _command(tmp_path, "--regions", "eu,us", "--rounds", "3", "--run-config", "local-steps=2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + patient(600)
        while time.monotonic() < deadline and process.poll() is None:
            found = list(runs.glob("run-*/metrics.json"))
            if found and '"1"' in found[0].read_text():  # round 1 has begun
                break
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=patient(120))
    except BaseException:  # SIGKILL to simulate alone would orphan its SuperLink and Ray
        stop_everything(tmp_path, [process.pid])
        raise
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "fedciuic: interrupted" in output
    left = processes_under(tmp_path)
    assert not left, "simulate left processes running:\n" + describe(left)
    data = only_run(runs)
    assert data["run"]["status"] == "interrupted", data["run"]
    run_dir = Path(data["run"]["output_dir"])
    assert "INTERRUPTED" in (run_dir / "summary.txt").read_text()
    report = subprocess.run(
        [sys.executable, "-m", "fedciuic.ops.cli", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    # The run did not end: the report says so, and its exit code too.
    assert report.returncode == EXIT_UNFINISHED, report.stdout + report.stderr
    assert "note: This run did not end (interrupted" in report.stdout
    assert "<b>interrupted</b>" in (run_dir / "report.html").read_text()


@pytest.mark.scenario
def test_the_realistic_preset_trains_one_sealed_dp_round(tmp_path):
    """The 207M-parameter DeepSeek-V3-shaped preset with its BPE tokenizer, end to end:
    both regions train under DP and their sealed updates are aggregated."""
    done = simulate(
        tmp_path,
        "--regions",
        "eu,cn",
        "--rounds",
        "1",
        "--run-config",
        "model-preset='realistic'",
        "--run-config",
        "local-steps=2",
        "--run-config",
        "batch-size=4",
        "--run-config",
        "max-eval-examples=8",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    # A real update: the default codec (int8) spends a byte on every trained entry of the
    # default adapter-mode's adapter, and the envelope holds it sealed.
    run = RunConfig.from_user_config({**app_config(), "model-preset": "realistic"}, source="t")
    assert run.compression.codec.name == "int8"
    trained = sum(math.prod(shape) for shape in AdapterLayout.of(run.model).shapes.values())
    for region in ("eu", "cn"):
        entry = data["rounds"]["1"]["train"][region]
        assert entry["status"] == "trained" and entry["epsilon"] > 0, entry
        assert entry["upload_bytes"] > entry["update_bytes"] >= trained, entry
    assert done.stdout.count("audit: OK: ") == 3, done.stdout
    assert not processes_under(tmp_path)


@pytest.mark.scenario
def test_a_buffered_run_with_a_slow_region_time_budgets_and_fedadam(tmp_path):
    """Real Flower processes with the heterogeneity settings together: buffered
    aggregation (K = 2 of 3 regions), us made 4x slower under a local time budget,
    fedadam on the server, two checkpoints kept (docs/heterogeneity.md)."""
    settings = [
        "aggregation-mode='buffered'",
        "buffer-size=2",
        "max-staleness=8",
        "test-region-slowdown='us=4'",
        "local-steps=20",
        "local-time-budget=1.5",
        "server-optimizer='fedadam'",
        "server-learning-rate=0.01",
        "keep-checkpoints=2",
    ]
    flags = [arg for setting in settings for arg in ("--run-config", setting)]
    # A time budget's steps are a figure of the data: under lab policies that let it out.
    done = simulate(tmp_path, "--rounds", "3", *flags, *exact_releases(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    data = only_run(tmp_path / "runs")
    assert data["run"]["status"] == "completed"
    steps: dict[str, list[int]] = {"eu": [], "cn": [], "us": []}
    for n in ("1", "2", "3"):
        rnd = data["rounds"][n]
        aggregate = rnd["aggregate"]
        assert aggregate["published"] and aggregate["version"] == int(n), aggregate
        assert len(aggregate["regions"]) >= 2  # K = 2; one update per region
        for region, entry in rnd["train"].items():
            if entry["status"] == "trained":
                assert entry["global_version"] + entry["staleness"] == int(n) - 1
                steps[region].append(entry["steps"])
    assert steps["us"] and steps["eu"]
    # The same budget buys the slowed region fewer steps: 1 <= us < eu <= local-steps.
    # Each count is planned from a timed step, so a busy machine can cut any one round
    # of eu's to 1; compare the best rounds, which a 4x slowdown keeps apart.
    assert max(steps["us"]) < max(steps["eu"]) <= 20, steps
    assert "steps/round" in done.stdout
    # every region evaluated the final adapter
    assert {"eu", "cn", "us", "overall"} <= set(data["rounds"]["3"]["eval"])
    run_dir = Path(data["run"]["output_dir"])
    kept = sorted(p.name for p in (run_dir / "checkpoint").glob("round-*"))
    assert kept == ["round-0002", "round-0003"]
    state = json.loads((run_dir / "checkpoint" / "round-0003" / "state.json").read_text())
    assert state["optimizer"]["name"] == "fedadam" and state["optimizer"]["steps"] == 3
    assert state["extra"]["version"] == 3
    (workdir,) = (tmp_path / "runs" / ".flower").iterdir()
    records = [
        json.loads(line)
        for line in (workdir / "audit" / "aggregator.audit.jsonl").read_text().splitlines()
    ]
    accepted = [r["details"] for r in records if r["event"] == "update_accepted"]
    assert accepted and all("global_version" in d and "staleness" in d for d in accepted)
    left = processes_under(tmp_path)
    assert not left, "simulate left processes running:\n" + describe(left)
