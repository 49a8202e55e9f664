"""Operating fedciuic: the ``fedciuic`` command (``cli``), the deployment folder
(``deploy``; the files it writes: ``layout``, rendered by ``render`` from
``templates/``), a run's outputs, progress and reports (``outputs``, ``progress``,
``run_report``). Imported by the command line, never by the library below it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.ops.outputs import summarize

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "summarize": "outputs",
}
__all__ = [
    "summarize",
]
__getattr__ = face(__name__, _WHERE)
