"""A run's ``metrics.json``: its schema (``metrics``, what ``ops/`` reads) and its
writer (``recorder``)."""
