"""ServerApp: read the run config, open the aggregator's run, hand its loop Flower's
Grid (``fedciuic.aggregator.loop``), end the run."""

from __future__ import annotations

from logging import ERROR, INFO

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from flwr.supercore.exit import add_exit_handler

from fedciuic.aggregator import (
    aggregator_log,
    crashed,
    end_run,
    finish_run,
    loop_for,
    open_run,
    run_failed,
    stopped,
    warn_disabled,
)
from fedciuic.audit import AuditLog
from fedciuic.config import RunConfig
from fedciuic.errors import FedciuicError
from fedciuic.flower import FlowerTransport
from fedciuic.model import AdapterLayout
from fedciuic.ops import summarize
from fedciuic.record import RunRecorder

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run = RunConfig.from_user_config(context.run_config, source="run config")
    except FedciuicError as err:
        log(ERROR, "fedciuic: %s", err)
        raise SystemExit(1) from None
    out_dir = run.output.output_path / f"run-{context.run_id}"
    recorder = RunRecorder(
        out_dir,
        {
            "run_id": context.run_id,
            "regions": list(run.regions),
            "config": run.flat(),
            "output_dir": str(out_dir),
        },
        summary=summarize,
    )
    log(INFO, "fedciuic: writing this run to %s", out_dir)
    # SIGINT/SIGTERM: Flower runs its exit handlers, then exits; the run is then
    # "interrupted", never "running" forever. (After a normal end it changes nothing.)
    add_exit_handler(
        lambda: stopped(recorder, "stopped by a signal (SIGINT/SIGTERM) before it ended"),
        run_before_force_exit=True,
    )
    warn_disabled(run)
    audit: AuditLog | None = None
    try:
        audit = aggregator_log(run)
        recorder.data.run.audit_log = str(audit.path)  # also for a run that fails
        # Adapter names, shapes and initial values from the base on the meta device: the
        # aggregator never holds the base model's weights.
        layout = AdapterLayout.of(run.model)
        recorder.data.run.base_fingerprint = layout.fingerprint
        opened = open_run(run, context.run_id, audit, recorder, layout.fingerprint)
        loop = loop_for(opened.aggregator, FlowerTransport(grid))
        loop.run(
            opened.resumed.adapter if opened.resumed else layout.initial,
            num_rounds=run.schedule.num_server_rounds,
            first_round=opened.first_round,
        )
        ended = end_run(opened.aggregator, audit, layout)
        loop.witness_run_end(run.schedule.round_timeout)
    except FedciuicError as err:
        run_failed(recorder, audit, context.run_id, err)
        raise SystemExit(1) from None
    except BaseException as err:
        crashed(recorder, err)
        raise
    finish_run(recorder, ended)
