"$BIN/flwr" supernode register @@{public_key} @@{connection} --name @@{region}
