#!/usr/bin/env bash
# Region @@{region} (policy @@{policy}): its agent (the only process that reads its data,
# state, keys and policy), its SuperNode, and Flower's ClientApp @@{as_user}: a relay to the agent.
# Runs until stopped; stopping it stops all three.
@@{preamble}
@@{data_check}
@@# The relay's user and home first (relay-setup makes them, as root), then the agent,
@@# which refuses to serve while that user can read the region's files.
"$BIN/python" -m fedciuic.ops.deploy relay-setup @@{relay_user} @@{relay_home}
"$BIN/fedciuic" agent --config @@{agent} &
AGENT=$!
SUPERNODE=
RELAY=
stop_region() {
  trap - EXIT
  # A second Ctrl-C, or an output closed under it, does not cut the clean-up short.
  trap '' INT TERM PIPE
  for pid in $RELAY $SUPERNODE $AGENT; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop_region EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"$BIN/fedciuic" agent --config @@{agent} --ping --pid "$AGENT" --timeout 120
"$BIN/flower-supernode" @@{security} \
  --superlink @@{superlink} --host 127.0.0.1 --port @@{port} \
  --isolation process --node-config @@{node_config} "$@" &
SUPERNODE=$!
@@# The relay stops with this script (the kernel's parent-death signal, set by `relay`).
"$BIN/python" -m fedciuic.ops.deploy relay @@{relay_user} @@{relay_home} -- \
  "$BIN/flower-superexec" --insecure --runtime-api-address 127.0.0.1:@@{port} &
RELAY=$!
rc=0
wait "$SUPERNODE" || rc=$?
exit "$rc"
