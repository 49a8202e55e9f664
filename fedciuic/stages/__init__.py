"""What each end of a round is handed once per run and never asks about again:
``sealing`` (sealed or clear, both ends) and ``audit`` (a log, or none)."""
