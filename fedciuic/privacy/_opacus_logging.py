"""Undo Opacus' import-time ``logging.basicConfig``.

``opacus.utils.module_utils`` adds a root handler when imported; Flower's logger
propagates to the root, so every Flower log line would then print twice. Modules
that import Opacus call :func:`undo_opacus_basic_config` right after.
"""

from __future__ import annotations

import logging

_OPACUS_FORMAT = "%(asctime)s:%(levelname)s:%(message)s"


def undo_opacus_basic_config() -> None:
    for handler in list(logging.root.handlers):
        if getattr(handler.formatter, "_fmt", None) == _OPACUS_FORMAT:
            logging.root.removeHandler(handler)
