"""The aggregator's side of the round, without Flower: ``round`` (per reply:
authenticate, open, validate, judge, record; then publish or withhold), ``run`` (a
run's start, resume and end), ``schedule`` (which regions each round asks) and
``checkpoint`` (the signed state a run resumes from)."""
