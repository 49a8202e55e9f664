"""The aggregator's side of the round, without Flower: ``loop`` (who is asked what and
when: synchronous rounds or buffered aggregates, over a ``Transport`` that Flower's Grid
implements in ``fedciuic.flower.courier``), ``round`` (per reply: authenticate, open,
validate, judge, record; then publish or withhold), ``run`` (a run's start, resume and
end), ``schedule`` (availability and buffered tasks) and ``checkpoint`` (the signed state
a run resumes from)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.aggregator.checkpoint import CHECKPOINT_DIR, LATEST
    from fedciuic.aggregator.loop import loop_for
    from fedciuic.aggregator.run import (
        aggregator_log,
        crashed,
        end_run,
        finish_run,
        open_run,
        run_failed,
        stopped,
        warn_disabled,
    )

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "CHECKPOINT_DIR": "checkpoint",
    "LATEST": "checkpoint",
    "aggregator_log": "run",
    "crashed": "run",
    "end_run": "run",
    "finish_run": "run",
    "loop_for": "loop",
    "open_run": "run",
    "run_failed": "run",
    "stopped": "run",
    "warn_disabled": "run",
}
__all__ = [
    "CHECKPOINT_DIR",
    "LATEST",
    "aggregator_log",
    "crashed",
    "end_run",
    "finish_run",
    "loop_for",
    "open_run",
    "run_failed",
    "stopped",
    "warn_disabled",
]
__getattr__ = face(__name__, _WHERE)
