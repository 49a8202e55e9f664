launch supernode-@@{region} bash @@{script}
