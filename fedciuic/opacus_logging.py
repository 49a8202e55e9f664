"""Undo Opacus' import-time ``logging.basicConfig``: each log line of a run once, in
Flower's format.

Opacus adds a root stderr handler, and Flower's ``flwr`` logger propagates to the root, so
every line would print twice. Each module importing Opacus calls
:func:`undo_opacus_basic_config` right after (tests/test_logging.py checks); only that
handler goes, so a user's own root handler and ``caplog`` still work.
"""

from __future__ import annotations

import logging

_OPACUS_FORMAT = "%(asctime)s:%(levelname)s:%(message)s"


def undo_opacus_basic_config() -> None:
    for handler in list(logging.root.handlers):
        if getattr(handler.formatter, "_fmt", None) == _OPACUS_FORMAT:
            logging.root.removeHandler(handler)
