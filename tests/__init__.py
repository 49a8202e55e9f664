"""The test suite. Set before anything imports torch: pytest-xdist runs the suite in
one worker per core (scripts/test.sh), and OpenMP threads that spin while they wait
for work, one team per worker on the same cores, doubled the unit tests' CPU time; so
each worker computes on one thread, and every thread sleeps while it waits (inherited
by the processes the tests start)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
