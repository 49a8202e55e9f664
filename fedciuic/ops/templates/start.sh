#!/usr/bin/env bash
# The whole federation on this machine: SuperLink, one SuperNode per region, one run.
# Extra arguments go to aggregator/run.sh. Every process started here is stopped on exit.
# Exit status: 2 when `fedciuic preflight` finds bad input (the model, its tokenizer or chat
# template, a region's data) before anything starts; else run.sh's (0 completed,
# @@{no_aggregate} no aggregate, 1 otherwise), then the run report's; 130 (SIGINT) or 143
# (SIGTERM) when interrupted before the run ended.
@@{preamble}
@@{plain}
# What this script and everything it starts print goes through two relays (stdout,
# stderr) that outlive a closed output: a `| head`, or a `| tee` that Ctrl-C stopped,
# stops nothing and cuts no clean-up short. They ignore SIGINT and SIGTERM, end once
# everything writing to them has, and start before the mark below (stop.sh spares them).
exec 2> >(trap '' INT TERM; plain >&2)
ERR_RELAY=$!
exec > >(trap '' INT TERM; plain)
OUT_RELAY=$!
relays_done() {  # close this script's output; give the relays 5 s to print what they hold
  exec >&- 2>&-
  local pid _
  for pid in "$OUT_RELAY" "$ERR_RELAY"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
}
trap relays_done EXIT
set -m  # each process started below leads its own process group
DIR=@@{dir}
# Every process started below, and all they start, carries this mark: stop.sh stops
# by it what outlived its parent.
export @@{owner_env}=@@{owner}
START=$(date +%s)
mkdir -p "$DIR/pids" "$DIR/logs"
if ! "$BIN/python" -m fedciuic.ops.scripts running "$DIR/pids"; then
  echo "start.sh: an earlier start.sh is still running; stop it with: bash $DIR/stop.sh" >&2
  exit 1
fi
rm -f "$DIR"/pids/*.pid
@@{data_checks}
@@# What a run would otherwise find minutes in (the run config's model, its tokenizer and
@@# chat template, each region's data, as its agent config names it), in seconds and
@@# before any process starts; exit 2 naming every problem. "$@": run.sh's arguments,
@@# whose --run-config values the run gets.
"$BIN/fedciuic" preflight --app @@{app} --run-config-file @@{run_config} \
  @@{agent_configs} -- "$@"

SIGNAL=    # 130 or 143 once SIGINT or SIGTERM asked this script to stop
REPORTED=  # the run report was written (not cut short by a Ctrl-C)
report_rc=0
report() {  # RUN_DIR: the run report; it verifies and cross-checks every party's log
  report_rc=0
  # In the background, as the run: a Ctrl-C comes to this script (not to the report,
  # as it would to a foreground job of its own), which stops the report and writes it
  # again, whole, in stop_all.
  "$BIN/fedciuic" report "$1" --keys @@{keys} @@{audit_logs} &
  wait "$!" || report_rc=$?
  REPORTED=1
}
stop_all() {
  local rc=$? outcome=0 run_dir
  trap - EXIT
  # A second Ctrl-C, or an output closed under it, does not cut the clean-up short.
  trap '' INT TERM PIPE
  set +e
  disown -a  # stopped by stop.sh, by PID: no job reports from this shell
  echo "start.sh: stopping every process it started" >&2
  bash "$DIR/stop.sh"
  # A run whose ServerApp was stopped before it ended must not stay "running".
  "$BIN/python" -m fedciuic.ops.scripts settle "$DIR/aggregator/runs" "$START"
  if [ -n "$SIGNAL" ]; then
    # Interrupted after the run had ended (flwr run or the report still at work): the
    # run's outcome stands, with its report.
    run_dir=$("$BIN/python" -m fedciuic.ops.scripts last-run "$DIR/aggregator/runs" "$START")
    outcome=$?
    if [ "$outcome" -eq 0 ] || [ "$outcome" -eq @@{no_aggregate} ]; then
      echo "start.sh: interrupted during clean-up; the run had ended: $run_dir" >&2
      [ -n "$REPORTED" ] || report "$run_dir"
      rc=$outcome
      [ "$rc" -ne 0 ] || rc=$report_rc
    fi
  fi
  relays_done
  exit "$rc"
}
trap stop_all EXIT
trap 'SIGNAL=130; exit 130' INT
trap 'SIGNAL=143; exit 143' TERM
launch() {  # NAME COMMAND...: in the background, logging to logs/NAME.log (no colours)
  local name=$1
  shift
  "$@" > >(plain >"$DIR/logs/$name.log") 2>&1 &
  echo "$!" >"$DIR/pids/$name.pid"
  echo "start.sh: $name (pid $!), log $DIR/logs/$name.log"
}

launch superlink bash @@{start_superlink}
"$BIN/python" -m fedciuic.ops.scripts wait-healthy @@{health_url} @@{ca} \
  "$DIR/pids/superlink.pid" "$DIR/logs/superlink.log"
@@# With TLS, the SuperNodes are admitted (register-supernodes.sh) before they start.
@@{launch_supernodes}

# In the background, so that a signal to this script is handled at once.
bash @@{run} "$@" &
echo "$!" >"$DIR/pids/flwr-run.pid"
run_rc=0
wait "$!" || run_rc=$?
echo "start.sh: results in $DIR/aggregator/runs"
# Every party's log is on this machine: the report of this run (the one written since
# this script started) prints each log's verdict and writes the run's compliance report
# (RUN_DIR/compliance-report-run-<id>.md and .html), as `fedciuic simulate` does, whatever
# the outcome.
run_dir=$("$BIN/python" -m fedciuic.ops.scripts last-run "$DIR/aggregator/runs" "$START" || true)
if [ -n "$run_dir" ]; then
  report "$run_dir"
fi
# The run's outcome first (@@{no_aggregate}: no aggregate was published), then the report's.
if [ "$run_rc" -ne 0 ]; then
  exit "$run_rc"
fi
exit "$report_rc"
