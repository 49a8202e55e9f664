"""What a run achieved, said plainly: no aggregate, interrupted, and the processes and
keys a simulation leaves behind (none, and one per region)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedciuic.config import RunConfig
from fedciuic.crypto.keys import KeyFileError, Keypair, load_keypair, write_keys
from fedciuic.errors import EXIT_ERROR, EXIT_NO_AGGREGATE
from fedciuic.ops import deploy, layout, scripts
from fedciuic.ops.cli import main
from fedciuic.ops.outputs import mark_unfinished, summarize
from fedciuic.ops.simulate import Interrupted, _simulation_keys
from fedciuic.processes import OWNER_ENV, owned_processes, owner_tag, stop_process_trees
from fedciuic.record.metrics import RunStatus, load_metrics
from fedciuic.record.recorder import RunRecorder, no_aggregate_reasons, published_rounds
from tests.conftest import ROOT, unit_config

# -- no aggregate ---------------------------------------------------------------------


def _declined_everywhere(tmp_path: Path) -> RunRecorder:
    recorder = RunRecorder(
        tmp_path,
        {"run_id": 9, "regions": ["eu", "us"], "config": {"num-server-rounds": 2, "dp": False}},
        summary=summarize,
    )
    for server_round in (1, 2):
        recorder.record_train(
            server_round, "eu", {"status": "declined", "reason": "over its budget 8"}
        )
        recorder.record_train(server_round, "us", {"status": "trained", "loss": 4.0})
        recorder.record_aggregate(
            server_round, {"published": False, "reasons": ["needs 2 regions, has 1"]}
        )
    return recorder


def test_a_run_with_no_published_aggregate_says_why_per_region(tmp_path):
    recorder = _declined_everywhere(tmp_path)
    assert published_rounds(recorder.data) == []
    reasons = no_aggregate_reasons(recorder.data)
    assert reasons == [
        "eu: declined in rounds 1, 2: over its budget 8",
        "us: trained in rounds 1, 2",
        "aggregate withheld in round 1: needs 2 regions, has 1",
        "aggregate withheld in round 2: needs 2 regions, has 1",
    ]
    recorder.finish(RunStatus.NO_AGGREGATE, adapter=None, reasons=reasons)
    text = (tmp_path / "summary.txt").read_text()
    assert "fedciuic run 9: no-aggregate" in text
    assert "NO AGGREGATE: none was published in 2 round(s)" in text
    assert "  eu: declined in rounds 1, 2: over its budget 8" in text
    assert "adapter:" not in text
    recorder.record_aggregate(1, {"published": True, "regions": ["eu", "us"]})
    assert published_rounds(recorder.data) == [1]


def test_a_region_that_never_replied_is_named(tmp_path):
    recorder = RunRecorder(
        tmp_path, {"run_id": 1, "regions": ["eu"], "config": {}}, summary=summarize
    )
    recorder.record_train(1, "us", {"status": "trained"})
    assert no_aggregate_reasons(recorder.data)[0] == "eu: no reply in any round"


# -- interrupted ----------------------------------------------------------------------


def test_interrupted_run_is_marked_interrupted_once_and_never_over_an_outcome(tmp_path):
    recorder = RunRecorder(
        tmp_path, {"run_id": 3, "regions": ["eu"], "config": {}}, summary=summarize
    )
    recorder.record_train(1, "eu", {"status": "trained"})
    recorder.record_end(1)
    recorder.record_train(2, "eu", {"status": "trained"})
    assert recorder.finish_unless_finished(RunStatus.INTERRUPTED, error="stopped by SIGTERM")
    data = load_metrics(tmp_path / "metrics.json")
    assert data.run.status == "interrupted"
    assert "INTERRUPTED in round 2 of ?: stopped by SIGTERM" in summarize(data)
    # An exit handler after a normal end changes nothing.
    assert not recorder.finish_unless_finished(RunStatus.INTERRUPTED, error="late")
    assert not mark_unfinished(tmp_path, "late")
    assert json.loads((tmp_path / "metrics.json").read_text())["run"]["error"] == (
        "stopped by SIGTERM"
    )
    assert not list(tmp_path.glob("*.tmp"))


def test_a_launcher_marks_a_run_its_process_left_running(tmp_path):
    RunRecorder(
        tmp_path / "run-5", {"run_id": 5, "regions": ["eu"], "config": {}}, summary=summarize
    )
    assert mark_unfinished(tmp_path / "run-5", "killed")
    data = json.loads((tmp_path / "run-5" / "metrics.json").read_text())
    assert (data["run"]["status"], data["run"]["error"]) == ("interrupted", "killed")
    assert (
        "INTERRUPTED before round 0 ended: killed"
        in (tmp_path / "run-5" / "summary.txt").read_text()
    )
    assert not mark_unfinished(tmp_path / "no-such-run", "killed")


def test_start_sh_settles_only_its_own_running_runs(tmp_path):
    old = RunRecorder(
        tmp_path / "run-1", {"run_id": 1, "regions": [], "config": {}}, summary=summarize
    )
    os.utime(old.directory / "metrics.json", (time.time() - 3600, time.time() - 3600))
    since = time.time()
    RunRecorder(tmp_path / "run-2", {"run_id": 2, "regions": [], "config": {}}, summary=summarize)
    done = RunRecorder(
        tmp_path / "run-3", {"run_id": 3, "regions": [], "config": {}}, summary=summarize
    )
    done.finish(RunStatus.COMPLETED)
    assert scripts.settle_runs(tmp_path, since) == [tmp_path / "run-2"]
    status = {
        p.parent.name: json.loads(p.read_text())["run"]["status"]
        for p in tmp_path.glob("run-*/metrics.json")
    }
    assert status == {"run-1": "running", "run-2": "interrupted", "run-3": "completed"}


def test_run_sh_exits_3_when_no_aggregate_was_published(tmp_path, capsys):
    runs = tmp_path / "runs"
    recorder = _declined_everywhere(runs / "run-77")
    recorder.finish(
        RunStatus.NO_AGGREGATE, adapter=None, reasons=no_aggregate_reasons(recorder.data)
    )
    log = tmp_path / "flwr.log"
    log.write_text("Successfully started run 77\n")
    config = tmp_path / "run-config.toml"
    config.write_text(f'output-dir = "{runs}"\n')
    assert scripts.check_run_log(log, config) == EXIT_NO_AGGREGATE == 3
    err = capsys.readouterr().err
    assert "published no aggregate in any round" in err
    assert "  eu: declined in rounds 1, 2: over its budget 8" in err


def test_run_and_start_scripts_strip_colours_and_start_sh_prints_every_verdict(tmp_path):
    d = deploy.init_deployment(
        tmp_path / "fed", "eu,cn", demo_data=True, tls=False, app_dir=Path("."), relay_user=""
    )
    start = (d.directory / "start.sh").read_text()
    run = (d.aggregator / "run.sh").read_text()
    assert '| plain "$LOG"' in run  # the stream to run.sh's log first, then to stdout
    assert '> >(plain >"$DIR/logs/$name.log")' in start
    assert f"export {OWNER_ENV}=" in start
    assert '"$BIN/fedciuic" report "$1"' in start and 'report "$run_dir"' in start
    assert "fedciuic.ops.scripts settle" in start
    # The filter itself: colour codes out, text kept.
    plain = subprocess.run(
        ["bash", "-c", layout.PLAIN.replace("$BIN", str(Path(sys.executable).parent)) + "plain"],
        input="\x1b[92mINFO \x1b[0m:      Starting\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.stdout == "INFO :      Starting\n", plain.stderr


# -- processes ------------------------------------------------------------------------


def _orphan(tmp_path: Path, env: dict[str, str], name: str) -> int:
    """A sleeper in a session of its own whose parent has exited (re-parented to init,
    as a Ray worker whose raylet died first); returns its PID."""
    pid_file = tmp_path / f"{name}.pid"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; "
            f"p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))",
        ],
        env=env,
        check=True,
        timeout=60,
    )
    return int(pid_file.read_text())


def test_simulate_leaves_no_ray_process_an_orphaned_worker_is_stopped_by_its_mark(tmp_path):
    owner = owner_tag("test", tmp_path)
    ours = _orphan(tmp_path, {**os.environ, OWNER_ENV: owner}, "ours")
    other = _orphan(tmp_path, {**os.environ, OWNER_ENV: owner_tag("other", tmp_path)}, "other")
    unmarked = _orphan(tmp_path, dict(os.environ), "unmarked")
    try:
        assert [p.pid for p in owned_processes(owner)] == [ours]
        assert stop_process_trees([], grace=5, owner=owner) == []
        assert not psutil.pid_exists(ours) or psutil.Process(ours).status() == "zombie"
        # Another launcher's processes (another Ray on the machine) are left alone.
        assert psutil.Process(other).is_running() and psutil.Process(unmarked).is_running()
    finally:
        for pid in (ours, other, unmarked):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


# -- simulate's input and keys ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["missing", "file", "no-region-folder"])
def test_a_bad_data_root_is_named_as_data_root_before_anything_starts(tmp_path, capsys, kind):
    root = tmp_path / "data"
    if kind == "file":
        root.write_text("")
    elif kind == "no-region-folder":
        (root / "other").mkdir(parents=True)
    out = tmp_path / "runs"
    code = main(["simulate", "--data-root", str(root), "--output-dir", str(out), "--quiet"])
    assert code == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"fedciuic: error: --data-root: {root}")
    assert "data-path" not in err and len(err.strip().splitlines()) == 1
    assert not (out / ".flower").exists()


def _run(regions: str = "eu,us") -> RunConfig:
    return RunConfig.from_user_config({**unit_config(), "regions": regions}, source="test")


def test_second_simulate_on_same_data_root_reuses_each_regions_key(tmp_path):
    root = tmp_path / "data"
    for region in ("eu", "us"):
        (root / region).mkdir(parents=True)
    first = _simulation_keys(tmp_path / "k1", root, _run())
    second = _simulation_keys(tmp_path / "k2", root, _run())
    for region in ("eu", "us"):
        kept = load_keypair(root / region / ".fedciuic" / "keys" / f"{region}.key.json")
        for keys in (first, second):
            assert load_keypair(keys / f"{region}.key.json").bundle.key_id == kept.bundle.key_id
    # The aggregator is fresh per invocation.
    assert (
        load_keypair(first / "aggregator.key.json").bundle.key_id
        != load_keypair(second / "aggregator.key.json").bundle.key_id
    )


def test_a_region_without_a_folder_gets_a_key_but_no_state_folder(tmp_path):
    root = tmp_path / "data"
    (root / "eu").mkdir(parents=True)
    keys = _simulation_keys(tmp_path / "k", root, _run())
    assert (keys / "us.key.json").exists() and not (root / "us").exists()


def test_a_kept_key_of_another_region_is_refused(tmp_path):
    root = tmp_path / "data"
    (root / "eu").mkdir(parents=True)
    write_keys(Keypair.generate("us", "US"), root / "eu" / ".fedciuic" / "keys")
    (root / "eu" / ".fedciuic" / "keys" / "us.key.json").rename(
        root / "eu" / ".fedciuic" / "keys" / "eu.key.json"
    )
    with pytest.raises(KeyFileError, match="the key of us \\(US\\), not of region eu"):
        _simulation_keys(tmp_path / "k", root, _run("eu"))


def test_stop_sh_spares_itself_and_the_start_sh_it_runs_under(tmp_path):
    owner = owner_tag("start.sh", tmp_path)
    code = (
        "import os; from fedciuic.processes import owned_processes; "
        f"print([p.pid for p in owned_processes({owner!r})], os.getppid())"
    )
    done = subprocess.run(
        ["bash", "-c", f"{sys.executable} -c {code!r}; true"],
        env={**os.environ, OWNER_ENV: owner},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.startswith("[] "), done.stdout + done.stderr


# -- simulate interrupted ---------------------------------------------------------------


class _Federation:
    """LocalFederation's stand-in for `fedciuic simulate`: its `flwr run` records run 77,
    which has ended as ``status`` (or is still running) when ``interrupt`` comes, while
    `flwr run` still streams; with no ``interrupt`` it returns."""

    status: RunStatus = RunStatus.COMPLETED
    interrupt: BaseException | None = None

    def __init__(self, workdir: Path, app: Path) -> None:
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True)

    def start_superlink(self, **_: object) -> str:
        return "127.0.0.1:1"

    def run_app(self, run_config: dict[str, object], **_: object) -> tuple[int, str]:
        (self.logs / "flwr-run-1.log").write_text("Successfully started run 77\n")
        recorder = _declined_everywhere(Path(str(run_config["output-dir"])) / "run-77")
        if self.status != RunStatus.RUNNING:
            recorder.finish(self.status)
        if self.interrupt is not None:
            raise self.interrupt
        return 77, ""

    def stop(self) -> list[psutil.Process]:
        return []


@pytest.mark.parametrize(
    ("status", "interrupt", "code"),
    [
        (RunStatus.COMPLETED, KeyboardInterrupt(), 0),
        (RunStatus.NO_AGGREGATE, Interrupted(signal.SIGTERM), 3),
        (RunStatus.RUNNING, KeyboardInterrupt(), 130),  # before the run ended: interrupted
    ],
)
def test_simulate_interrupted_after_its_run_ended_reports_it_and_exits_by_its_outcome(
    tmp_path, capsys, monkeypatch, status, interrupt, code
):
    audited: list[Path] = []

    def audit(run_dir: Path) -> int:
        audited.append(run_dir)
        return 0

    monkeypatch.setattr(_Federation, "status", status)
    monkeypatch.setattr(_Federation, "interrupt", interrupt)
    monkeypatch.setattr("fedciuic.flower.LocalFederation", _Federation)
    monkeypatch.setattr("fedciuic.ops.simulate._audit_after_simulation", audit)
    runs = tmp_path / "runs"
    args = ["simulate", "--app", str(ROOT), "--regions", "eu,us", "--output-dir", str(runs)]
    assert main([*args, "--quiet"]) == code
    err = capsys.readouterr().err
    run = load_metrics(runs / "run-77" / "metrics.json").run
    if code == 130:
        assert run.status == RunStatus.INTERRUPTED and not audited
        assert "fedciuic: interrupted" in err and "during clean-up" not in err
        return
    assert run.status == status and audited == [runs / "run-77"]  # its report is written
    name = signal.Signals(getattr(interrupt, "signum", signal.SIGINT)).name
    assert f"fedciuic: interrupted ({name}) during clean-up, after run 77 had ended ({status})" in (
        err
    )


def test_a_ctrl_c_while_simulate_writes_the_report_of_an_ended_run_is_noted_not_raised(
    tmp_path, capsys, monkeypatch
):
    def audit(run_dir: Path) -> int:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, half-way through the report
        (run_dir / "report.html").write_text("the whole report")
        return 0

    monkeypatch.setattr("fedciuic.flower.LocalFederation", _Federation)
    monkeypatch.setattr("fedciuic.ops.simulate._audit_after_simulation", audit)
    runs = tmp_path / "runs"
    args = ["simulate", "--app", str(ROOT), "--regions", "eu,us", "--output-dir", str(runs)]
    assert main([*args, "--quiet"]) == 0
    assert (runs / "run-77" / "report.html").read_text() == "the whole report"
    assert "interrupted (SIGINT) during clean-up, after run 77 had ended" in (
        capsys.readouterr().err
    )
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was
