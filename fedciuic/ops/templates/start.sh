#!/usr/bin/env bash
# The whole federation on this machine: SuperLink, one SuperNode per region, one run.
# Extra arguments go to aggregator/run.sh. Every process started here is stopped on exit.
@@{preamble}
@@{plain}
set -m  # each process started below leads its own process group
DIR=@@{dir}
# Every process started below, and all they start, carries this mark: stop.sh stops
# by it what outlived its parent.
export @@{owner_env}=@@{owner}
START=$(date +%s)
mkdir -p "$DIR/pids" "$DIR/logs"
if ! "$BIN/python" -m fedciuic.ops.deploy running "$DIR/pids"; then
  echo "start.sh: an earlier start.sh is still running; stop it with: bash $DIR/stop.sh" >&2
  exit 1
fi
rm -f "$DIR"/pids/*.pid
@@{data_checks}

stop_all() {
  local rc=$?
  trap - EXIT INT TERM
  echo "start.sh: stopping every process it started"
  disown -a  # stopped by stop.sh, by PID: no job reports from this shell
  bash "$DIR/stop.sh" || true
  # A run whose ServerApp was stopped before it ended must not stay "running".
  "$BIN/python" -m fedciuic.ops.deploy settle "$DIR/aggregator/runs" "$START" || true
  exit "$rc"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
launch() {  # NAME COMMAND...: in the background, logging to logs/NAME.log (no colours)
  local name=$1
  shift
  "$@" > >(plain >"$DIR/logs/$name.log") 2>&1 &
  echo "$!" >"$DIR/pids/$name.pid"
  echo "start.sh: $name (pid $!), log $DIR/logs/$name.log"
}

launch superlink bash @@{start_superlink}
"$BIN/python" -m fedciuic.ops.deploy wait-healthy @@{health_url} @@{ca} \
  "$DIR/pids/superlink.pid" "$DIR/logs/superlink.log"
@@# With TLS, the SuperNodes are admitted (register-supernodes.sh) before they start.
@@{launch_supernodes}

# In the background, so that a signal to this script is handled at once.
bash @@{run} "$@" &
echo "$!" >"$DIR/pids/flwr-run.pid"
run_rc=0
wait "$!" || run_rc=$?
echo "start.sh: results in $DIR/aggregator/runs"
# Every party's log is on this machine: the run report verifies and cross-checks them
# all, and prints each log's verdict (as `fedciuic simulate` does), whatever the outcome.
report_rc=0
run_dir=$(ls -td "$DIR"/aggregator/runs/run-*/ 2>/dev/null | head -1 || true)
if [ -n "$run_dir" ]; then
  "$BIN/fedciuic" report "$run_dir" --keys @@{keys} @@{audit_logs} || report_rc=$?
fi
# The run's outcome first (@@{no_aggregate}: no aggregate was published), then the audit's.
if [ "$run_rc" -ne 0 ]; then
  exit "$run_rc"
fi
exit "$report_rc"
