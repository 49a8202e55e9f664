#!/usr/bin/env bash
# Stop every process start.sh started (pids/*.pid) and everything they started.
@@{preamble}
"$BIN/python" -m fedciuic.ops.scripts stop @@{pids}
