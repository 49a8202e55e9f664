#!/usr/bin/env bash
# Region @@{region}'s SuperNode: trains on data/ under @@{policy}, runs until stopped.
@@{preamble}
@@{data_check}
@@{start_trainer}
"$BIN/flower-supernode" @@{security} \
  --superlink @@{superlink} --host 127.0.0.1 --port @@{port} \
  --node-config @@{node_config} "$@"
