"""What every benchmark script shares with ``run_all.py``: a table row and its verdict.

Each script in ``run_all.BENCHMARKS`` defines ``rows(result) -> list[Row]`` (its lines
of the README table, from the JSON it wrote with ``--json``) and may define
``plot(result, out) -> list[Path]``; ``run_all.py`` only collects them.
"""

from __future__ import annotations

#: (figure, measured, target, verdict)
Row = list[str]


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"
