"""`fedciuic budget`: each dataset's spend against its lifetime budget, read from its
ledger before a run starts, and whether a run's target still fits."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from fedciuic.agent.config import AgentConfig
from fedciuic.config import COUNTS, TRAINING, DPSettings, NodeConfig, Purpose
from fedciuic.ops.cli import main
from fedciuic.privacy.budget import budget_status
from fedciuic.privacy.ledger import LEDGER_FILE, PrivacyLedger, calibrate_noise, epsilon_of
from tests.conftest import ROOT, app_config

DATASET = "ab" * 32


def spend(
    state_dir: Path,
    region: str,
    steps: list[tuple[int, tuple[float, float, int]]],
    purposes: Sequence[Purpose] = (),
) -> float:
    """Append releases (run id, step) to the region's ledger, of ``purposes`` (default:
    training); its cumulative epsilon."""
    ledger = PrivacyLedger.open(
        state_dir / LEDGER_FILE,
        region=region,
        dataset=DATASET,
        delta=1e-5,
        accountant="prv",
        unit="user",
    )
    for number, (run_id, step) in enumerate(steps, 1):
        purpose = purposes[number - 1] if purposes else TRAINING
        ledger.append(
            ledger.new_record(
                run_id=run_id,
                server_round=number,
                step=step,
                max_grad_norm=1.0,
                secure_mode=False,
                epsilon=ledger.epsilon_after(step),
                purpose=purpose,
                count=1200 if purpose == COUNTS else None,
            )
        )
    return ledger.epsilon


def test_a_dataset_without_a_ledger_has_spent_nothing(tmp_path):
    status = budget_status("eu", tmp_path / "state", 8.0)
    assert status.spent == 0 and status.remaining == 8.0
    assert status.after_run(8.0, 90) == 8.0 and status.run_line(8.0, 90)[0]
    assert not status.run_line(8.5, 90)[0]
    assert status.line().startswith("eu: nothing spent, budget 8 (no ledger yet at ")
    assert not (tmp_path / "state").exists()  # reading creates nothing


def test_a_ledgers_releases_runs_and_remaining_budget_are_read_as_recorded(tmp_path):
    state = tmp_path / "state"
    spent = spend(state, "eu", [(7, (1.0, 0.1, 30)), (7, (1.0, 0.1, 30)), (9, (1.0, 0.1, 30))])
    before = (state / LEDGER_FILE).read_bytes()
    status = budget_status("eu", state, 8.0)
    assert (status.spent, len(status.history), status.runs, status.unit) == (spent, 3, 2, "user")
    assert status.remaining == pytest.approx(8.0 - spent)
    assert f"epsilon {spent:.2f} of 8 spent per user" in status.line()
    assert f"{8.0 - spent:.2f} left" in status.line()
    assert (state / LEDGER_FILE).read_bytes() == before


def test_the_projection_is_the_regions_own_accounting_of_a_whole_run(tmp_path):
    """A run's noise calibrated for its target alone, at the dataset's last sample rate,
    composed with the history: less than spent + target, and what the ledger would hold."""
    state = tmp_path / "state"
    spend(state, "eu", [(1, (1.2, 0.1, 90))])
    status = budget_status("eu", state, 8.0)
    sigma = calibrate_noise(4.0, 1e-5, 0.1, 90, "prv")
    composed = epsilon_of([(1.2, 0.1, 90), (sigma, 0.1, 90)], 1e-5, "prv")
    assert status.after_run(4.0, 90) == pytest.approx(composed)
    assert status.spent < composed < status.spent + 4.0  # composed, not added


def test_a_run_that_does_not_fit_what_is_left_is_said_and_exits_1(tmp_path, capsys):
    data_root = tmp_path / "data"
    eu = NodeConfig(region="eu", data_path=str(data_root / "eu")).state_dir
    spent = spend(eu, "eu", [(1, (1.0, 0.1, 120))])
    assert 7.0 < spent < 8.0  # most of the budget is gone
    (data_root / "us").mkdir(parents=True)
    args = ["budget", "--data-root", str(data_root), "--regions", "eu,us", "--app", str(ROOT)]
    assert main(args) == 1
    out = capsys.readouterr().out
    app = app_config()
    steps = app["num-server-rounds"] * app["local-steps"]
    target = app["target-epsilon"]
    assert re.search(
        rf"^eu: a run at target-epsilon {target:g} \({steps} steps\) would bring it to "
        r"([\d.]+) of 8: does not fit \(the region declines each round that would go past 8\)",
        out,
        re.M,
    ), out
    assert "us: nothing spent, budget 8" in out and "us: a run" not in out
    # A smaller run fits: fewer steps at a lower target, without the DP count and
    # evaluations (which alone would cost more than 0.5: refused, naming the keys).
    small = ["--run-config", "target-epsilon=0.5", "--run-config", "local-steps=2"]
    assert main([*args, *small]) == 2
    assert "leaves nothing for training" in capsys.readouterr().err
    small += ["--run-config", "count-noise=0", "--run-config", "eval-noise=0"]
    assert main([*args, *small]) == 0
    assert "eu: a run at target-epsilon 0.5 (6 steps) would bring it to" in capsys.readouterr().out


def test_a_deployed_regions_budget_is_its_agent_configs_not_the_run_configs(tmp_path, capsys):
    config = tmp_path / "agent.toml"
    config.write_text(
        'region = "eu"\ndata-path = "data"\nstate-path = "state"\nkey-file = "k"\n'
        'aggregator-bundle = "b"\npolicy = "p.yaml"\nsocket = "agent.sock"\n'
        "epsilon-budget = 12.0\n"
    )
    agent = AgentConfig.load(config)
    spent = spend(agent.state_dir, "eu", [(1, (1.0, 0.1, 90))])
    assert DPSettings().epsilon_budget == 8.0 < spent + 4 <= 12.0
    assert main(["budget", str(config), "--app", str(ROOT)]) == 0
    assert f"eu: epsilon {spent:.2f} of 12 spent per user" in capsys.readouterr().out


def test_a_damaged_ledger_is_its_regions_line_and_the_others_are_still_shown(tmp_path, capsys):
    data_root = tmp_path / "data"
    eu = NodeConfig(region="eu", data_path=str(data_root / "eu")).state_dir
    spend(eu, "eu", [(1, (1.0, 0.1, 30))])
    (eu / LEDGER_FILE).write_bytes((eu / LEDGER_FILE).read_bytes()[:-5])
    (data_root / "us").mkdir(parents=True)
    args = ["budget", "--data-root", str(data_root), "--regions", "eu,us", "--app", str(ROOT)]
    assert main(args) == 1  # a run does not fit a region that cannot read its ledger
    out = capsys.readouterr().out
    (eu_line,) = [line for line in out.splitlines() if line.startswith("eu:")]
    assert str(eu / LEDGER_FILE) in eu_line and "truncated" in eu_line
    assert eu_line.endswith("(the region declines every round until it is fixed)")
    assert "us: nothing spent, budget 8" in out and "Traceback" not in out


def test_budget_wants_agent_configs_or_a_data_root_not_both(tmp_path, capsys):
    assert main(["budget", "--app", str(ROOT)]) == 2
    assert "give either agent configs (a deployment) or --data-root" in capsys.readouterr().err


def test_a_runs_count_of_units_is_shown_by_purpose_and_a_run_is_projected_from_training(
    tmp_path,
):
    state = tmp_path / "state"
    count, train = (3.0, 1.0, 1), (1.0, 0.1, 30)
    spend(state, "eu", [(7, count), (7, train)], [COUNTS, TRAINING])
    status = budget_status("eu", state, 16.0)
    alone = status.by_purpose()
    assert alone == pytest.approx(
        {"counts": epsilon_of([count], 1e-5, "prv"), "training": epsilon_of([train], 1e-5, "prv")}
    )
    assert f"counts alone {alone['counts']:.2f}" in status.line()
    # The next run samples at the last *training* rate (0.1), not the count's 1.
    sigma = calibrate_noise(4.0, 1e-5, 0.1, 90, "prv")
    assert status.after_run(4.0, 90) == pytest.approx(
        epsilon_of([count, train, (sigma, 0.1, 90)], 1e-5, "prv")
    )
    assert status.after_run(4.0, 90, (count,)) > status.after_run(4.0, 90)
