"""The aggregator's side of the round, without Flower: ``loop`` (who is asked what and
when: synchronous rounds or buffered aggregates, over a ``Transport`` that Flower's Grid
implements in ``fedciuic.flower.courier``), ``round`` (per reply: authenticate, open,
validate, judge, record; then publish or withhold), ``run`` (a run's start, resume and
end), ``schedule`` (availability and buffered tasks), ``checkpoint`` (the signed state
a run resumes from), ``aggregation`` (updates checked and decoded into one accumulator,
or a robust rule) and ``server_optim`` (the server's step on the aggregate)."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.aggregator.checkpoint import CHECKPOINT_DIR as CHECKPOINT_DIR
    from fedciuic.aggregator.checkpoint import LATEST as LATEST
    from fedciuic.aggregator.loop import loop_for as loop_for
    from fedciuic.aggregator.run import aggregator_log as aggregator_log
    from fedciuic.aggregator.run import crashed as crashed
    from fedciuic.aggregator.run import end_run as end_run
    from fedciuic.aggregator.run import finish_run as finish_run
    from fedciuic.aggregator.run import open_run as open_run
    from fedciuic.aggregator.run import run_failed as run_failed
    from fedciuic.aggregator.run import stopped as stopped
    from fedciuic.aggregator.run import warn_disabled as warn_disabled

__getattr__ = face(__name__)  # each name imported on first use: torch is behind them
