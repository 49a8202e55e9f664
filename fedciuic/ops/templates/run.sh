#!/usr/bin/env bash
# Submit the app to the SuperLink and stream its log; extra arguments go to `flwr run`,
# e.g. --run-config "num-server-rounds=5 local-steps=50". Exit 0 only if the run completed;
# @@{no_aggregate} if it published no aggregate (nothing trained), 1 otherwise.
@@{preamble}
@@# Flower takes a TOML file or key=value pairs, not both: pass the file as pairs so
@@# that the caller's --run-config can follow (later values win).
PAIRS="$("$BIN/python" -m fedciuic.ops.scripts run-config @@{config})"
@@{plain}
LOG="$(mktemp)"
APP="$(mktemp -d)"
trap 'rm -rf "$LOG" "$APP"' EXIT
@@# Only the files the app's FAB holds: `flwr run` on the app folder itself would read
@@# every file under it, its environment's included.
"$BIN/python" -m fedciuic.ops.scripts stage-app @@{app} "$APP"
@@# The stream goes to $LOG first, then to stdout: a closed stdout (a `| head`, a
@@# `| tee` that Ctrl-C stopped) neither stops `flwr run` nor loses the run's outcome.
rc=0
"$BIN/flwr" run "$APP" @@{connection} --stream --run-config "$PAIRS" "$@" 2>&1 | plain "$LOG" || rc=$?
@@# 0 completed; @@{no_aggregate} no aggregate published (nothing trained); 1 anything else.
outcome=0
"$BIN/python" -m fedciuic.ops.scripts check-run "$LOG" @@{config} || outcome=$?
[ "$outcome" -eq 0 ] || rc=$outcome
exit "$rc"
