"""Undo Opacus' import-time ``logging.basicConfig``: each log line of a run once, in
Flower's format.

``opacus.utils.module_utils`` adds a stderr handler to the root logger when it is first
imported (through any ``opacus`` import, even ``opacus.accountants``). Flower's ``flwr``
logger, which every fedciuic line goes through, prints with its own console handler and
propagates to the root, so every line would then print twice: ``INFO :      round 1``
and ``11/29/2026 02:56:05:INFO:round 1``. Every module that imports Opacus calls
:func:`undo_opacus_basic_config` right after (``tests/test_logging.py`` checks that
they do, and that a ServerApp process prints each line once).

Only that handler goes: a root handler of the user's own stays, and pytest's ``caplog``
still sees Flower's lines through the root.
"""

from __future__ import annotations

import logging

_OPACUS_FORMAT = "%(asctime)s:%(levelname)s:%(message)s"


def undo_opacus_basic_config() -> None:
    for handler in list(logging.root.handlers):
        if getattr(handler.formatter, "_fmt", None) == _OPACUS_FORMAT:
            logging.root.removeHandler(handler)
