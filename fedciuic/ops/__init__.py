"""Operating fedciuic: the ``fedciuic`` command (``cli``, its parser; ``commands``, what
each does; ``simulate``), the deployment folder
(``deploy``; the files it writes: ``layout``, rendered by ``render`` from
``templates/``), a run's outputs, progress and reports (``outputs``, ``progress``,
``run_report``). Imported by the command line, never by the library below it."""

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.ops.outputs import summarize as summarize

__getattr__ = face(__name__)  # each name imported on first use: torch is behind them
