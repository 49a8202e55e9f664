"""Undo Opacus' import-time ``logging.basicConfig``: each log line of a run once, in
Flower's format.

Any ``opacus`` import adds a stderr handler to the root logger, and Flower's ``flwr``
logger, which every fedciuic line goes through, propagates to the root: every line
would print twice. Every module that imports Opacus calls
:func:`undo_opacus_basic_config` right after (``tests/test_logging.py`` checks). Only
that handler goes: a root handler of the user's own stays, and ``caplog`` still works.
"""

from __future__ import annotations

import logging

_OPACUS_FORMAT = "%(asctime)s:%(levelname)s:%(message)s"


def undo_opacus_basic_config() -> None:
    for handler in list(logging.root.handlers):
        if getattr(handler.formatter, "_fmt", None) == _OPACUS_FORMAT:
            logging.root.removeHandler(handler)
