@@# The region's trainer (node config trainer='service'): Flower starts a ClientApp
@@# process per message; this one keeps the model, data and keys for the whole run.
# The region's trainer: holds the model for the whole run (node config trainer='service');
# it stops with this script.
"$BIN/fedciuic" trainer --state-path @@{state} &
TRAINER=$!
trap 'kill "$TRAINER" 2>/dev/null || true; wait "$TRAINER" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"$BIN/fedciuic" trainer --state-path @@{state} --ping --pid "$TRAINER" --timeout 120
