"""A region as a cluster: its long-lived trainer service and its training processes."""
