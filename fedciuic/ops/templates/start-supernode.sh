#!/usr/bin/env bash
# Region @@{region} (policy @@{policy}): its agent (the only process that reads its data,
# state, keys and policy), its SuperNode, and Flower's ClientApp @@{as_user}: a relay to the agent.
# Runs until stopped; the three live and die together: stopping this script stops all
# three, and when one of them stops, the script stops the other two and exits non-zero,
# saying which and why (so that Flower sees the node offline, not a node nobody answers).
@@{preamble}
@@{data_check}
@@# The relay's user and home first (relay-setup checks that it can reach them and the
@@# agent's socket, and makes them, as root), then the agent, which refuses to serve
@@# while that user can read the region's files.
"$BIN/python" -m fedciuic.ops.scripts relay-setup @@{relay_user} @@{relay_home} @@{socket}
@@# Tied like the SuperNode below: an agent that watched for its parent only once its
@@# imports were done would take a kill -9 of this script in its first seconds for its
@@# parent's (re-parented) self and serve on, holding the region's lock.
"$BIN/python" -m fedciuic.ops.scripts tied $$ -- "$BIN/fedciuic" agent --config @@{agent} &
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
@@# The agent, the SuperNode and the relay carry the kernel's parent-death signal (`tied`,
@@# `relay`, told this script's PID, $$): a kill -9 of this script, which runs no
@@# clean-up, leaves none of the three running. The relay stays the parent of Flower's
@@# SuperExec and ends its ClientApps with it (a process group of their own).
"$BIN/fedciuic" agent --config @@{agent} --ping --pid "$AGENT" --timeout 120
"$BIN/python" -m fedciuic.ops.scripts tied $$ -- "$BIN/flower-supernode" @@{security} \
  --superlink @@{superlink} --host 127.0.0.1 --port @@{port} \
  --isolation process --node-config @@{node_config} "$@" &
SUPERNODE=$!
"$BIN/python" -m fedciuic.ops.scripts relay @@{relay_user} @@{relay_home} $$ -- \
  "$BIN/flower-superexec" --insecure --runtime-api-address 127.0.0.1:@@{port} &
RELAY=$!
@@# Until the first of the three ends (a signal to this script ends the wait, and its
@@# trap stops all three).
rc=0
wait -n "$AGENT" "$SUPERNODE" "$RELAY" || rc=$?
stopped="one of its processes"
for each in "agent:$AGENT" "SuperNode (flower-supernode):$SUPERNODE" "@@{relay}:$RELAY"; do
  kill -0 "${each##*:}" 2>/dev/null || { stopped="its ${each%:*}"; break; }
done
why="exit status $rc; its own lines above say why"
[ "$rc" -le 128 ] || why="killed by SIG$(kill -l "$((rc - 128))")"
echo "start-supernode.sh: region @@{region} stops: $stopped exited ($why); stopping the others so that Flower sees the node offline" >&2
[ "$rc" -ne 0 ] || rc=1
exit "$rc"
