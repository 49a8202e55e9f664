"""A region's side of the round, without Flower: ``round`` (the region's whole round:
an instruction in, checks, keys, policy, training, sealing, its audit trail, and a typed
outcome out), ``trainer`` (the model, data and DP part of it) and ``cache`` (the regions
a process keeps open between rounds)."""
