"""Codecs for adapter deltas, with error feedback (pure NumPy, no Flower).

A delta is a flat float32 vector (the adapter tensors in name order; both sides know
the layout from the global adapter). A codec, picked by name from :data:`CODECS`
(``dense``, ``int8``, ``int4``, ``int2``, ``sign``, ``topk:F``, ``topk-int8:F``,
``topk-int4:F``, ``topk-sign:F``; F, the kept fraction, in (0, 1]), turns it into bytes
in a versioned wire format (``codecs``) and back. Top-k indices are coded near
log2 C(n, k) (``indices``); values as fp32, int8, int4, int2 (each stochastically
rounded, unbiased) or sign (``values``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedciuic.faces import face

if TYPE_CHECKING:
    from fedciuic.compression.codecs import (
        CODECS,
        UPDATE_FORMAT,
        Codec,
        CodecFamily,
        Sparse,
        get_codec,
        update_entries,
    )
    from fedciuic.compression.errors import MalformedUpdate, ResidualError
    from fedciuic.compression.feedback import (
        RESIDUAL_FORMAT,
        ErrorFeedback,
        compress_with_feedback,
        flatten,
        layout_id,
        layout_of,
        unflatten,
    )
    from fedciuic.compression.values import CHUNK

#: What other packages use, and the module each lives in: imported on first use.
_WHERE = {
    "CHUNK": "values",
    "CODECS": "codecs",
    "Codec": "codecs",
    "CodecFamily": "codecs",
    "ErrorFeedback": "feedback",
    "UPDATE_FORMAT": "codecs",
    "MalformedUpdate": "errors",
    "RESIDUAL_FORMAT": "feedback",
    "ResidualError": "errors",
    "Sparse": "codecs",
    "compress_with_feedback": "feedback",
    "flatten": "feedback",
    "get_codec": "codecs",
    "layout_id": "feedback",
    "layout_of": "feedback",
    "unflatten": "feedback",
    "update_entries": "codecs",
}
__all__ = [
    "CHUNK",
    "CODECS",
    "RESIDUAL_FORMAT",
    "UPDATE_FORMAT",
    "Codec",
    "CodecFamily",
    "ErrorFeedback",
    "MalformedUpdate",
    "ResidualError",
    "Sparse",
    "compress_with_feedback",
    "flatten",
    "get_codec",
    "layout_id",
    "layout_of",
    "unflatten",
    "update_entries",
]
__getattr__ = face(__name__, _WHERE)
