#!/usr/bin/env bash
# The SuperLink (relay) of this federation on @@{superlink}; runs until stopped.
@@{preamble}
exec "$BIN/flower-superlink" @@{security} \
  --host @@{host} --port @@{port} --disable-runtime-dependency-installation "$@"
