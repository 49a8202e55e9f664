"""Codecs for adapter deltas, with error feedback (pure NumPy, no Flower).

A delta is a flat float32 vector (the adapter tensors in name order; both sides know
the layout from the global adapter). A codec, picked by name from :data:`CODECS`
(``dense``, ``int8``, ``sign``, ``topk:F``, ``topk-int8:F``, ``topk-int4:F``,
``topk-sign:F``; F, the kept fraction, in (0, 1]), turns it into bytes in a versioned
wire format (``codecs``) and back. Top-k indices are coded near log2 C(n, k)
(``indices``); values as fp32, int8, int4 or sign (``values``).
"""

from fedciuic.compression.codecs import (
    CODECS,
    FORMAT,
    Codec,
    CodecFamily,
    Sparse,
    get_codec,
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

__all__ = [
    "CHUNK",
    "CODECS",
    "FORMAT",
    "RESIDUAL_FORMAT",
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
]
