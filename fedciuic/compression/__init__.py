"""Codecs for adapter deltas, with error feedback (pure NumPy, no Flower).

A delta is a flat float32 vector (the adapter tensors in name order); a codec turns it
into versioned bytes (``codecs``), top-k indices near log2 C(n, k) (``indices``) and
values as fp32, int8, int4, int2 or sign (``values``).
"""

from fedciuic.compression.codecs import Codec as Codec
from fedciuic.compression.codecs import CodecFamily as CodecFamily
from fedciuic.compression.codecs import Sparse as Sparse
from fedciuic.compression.codecs import get_codec as get_codec
from fedciuic.compression.codecs import update_entries as update_entries
from fedciuic.compression.feedback import ErrorFeedback as ErrorFeedback
from fedciuic.compression.feedback import compress_with_feedback as compress_with_feedback
from fedciuic.compression.feedback import flatten as flatten
from fedciuic.compression.feedback import layout_id as layout_id
from fedciuic.compression.feedback import layout_of as layout_of
from fedciuic.compression.feedback import unflatten as unflatten
