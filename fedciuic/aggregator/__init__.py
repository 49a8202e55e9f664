"""The aggregator's side of the round, without Flower: ``loop`` (who is asked what and
when: synchronous rounds or buffered aggregates, over a ``Transport`` that Flower's Grid
implements in ``fedciuic.flower.courier``), ``round`` (per reply: authenticate, open,
validate, judge, record; then publish or withhold), ``run`` (a run's start, resume and
end), ``schedule`` (availability and buffered tasks) and ``checkpoint`` (the signed state
a run resumes from)."""
