"""Codecs, their error bounds, error feedback and sparse aggregation."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fedciuic.compression import (
    CHUNK,
    ErrorFeedback,
    ResidualError,
    compress_with_feedback,
    get_codec,
)
from fedciuic.config import RunConfig
from fedciuic.errors import ConfigError

SPECS = ["dense", "int8", "sign", "topk:0.05", "topk-int8:0.05", "topk-int4:0.05", "topk-sign:0.05"]
N = 3 * CHUNK + 17  # a partial last chunk


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(N).astype(np.float32)


def test_topk_keeps_exactly_the_k_largest_magnitudes(x):
    codec = get_codec("topk:0.05")
    k = codec.k(N)
    got = codec.decode(codec.encode(x, np.random.default_rng(0)), N)
    assert got.indices is not None and len(got.indices) == k
    assert set(got.indices.tolist()) == set(np.argsort(-np.abs(x))[:k].tolist())
    np.testing.assert_array_equal(got.values, x[got.indices])  # exact values


def chunk_max(x: np.ndarray) -> np.ndarray:
    pad = np.pad(np.abs(x), (0, (-x.size) % CHUNK)).reshape(-1, CHUNK)
    return np.repeat(pad.max(axis=1), CHUNK)[: x.size]


def test_int8_error_is_below_one_quantisation_step(x):
    codec = get_codec("int8")
    sent = codec.decode(codec.encode(x, np.random.default_rng(0)), N).dense(N)
    step = chunk_max(x) / 127  # documented bound: |error| < max|chunk| / 127
    assert np.all(np.abs(sent - x) <= step * (1 + 1e-6))


def test_int8_stochastic_rounding_is_unbiased(x):
    codec = get_codec("int8")
    rng = np.random.default_rng(0)
    mean = np.mean([codec.decode(codec.encode(x, rng), N).dense(N) for _ in range(400)], axis=0)
    assert np.abs(mean - x).max() < 0.2 * (chunk_max(x) / 127).max()


def test_sign_error_is_within_its_bound(x):
    codec = get_codec("sign")
    sent = codec.decode(codec.encode(x, np.random.default_rng(0)), N).dense(N)
    assert np.all(np.sign(sent) == np.where(x >= 0, 1, -1))
    assert np.all(np.abs(sent - x) <= chunk_max(x) * (1 + 1e-6))  # documented bound


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_invariant(x, spec):
    codec = get_codec(spec)
    old = np.random.default_rng(2).standard_normal(N).astype(np.float32) * 0.1
    encoded, new = compress_with_feedback(x, old, codec, np.random.default_rng(3))
    sent = codec.decode(encoded, N).dense(N)
    np.testing.assert_allclose(sent + new, x + old, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_sparse_aggregate_equals_a_dense_reference(spec):
    codec = get_codec(spec)
    rng = np.random.default_rng(4)
    updates = [rng.standard_normal(N).astype(np.float32) for _ in range(5)]
    weights = [3.0, 1.0, 7.0, 2.0, 5.0]
    encoded = [codec.encode(u, rng) for u in updates]
    acc = np.zeros(N, np.float64)
    for blob, w in zip(encoded, weights, strict=True):
        codec.decode(blob, N).add_into(acc, w)
    reference = sum(
        w * codec.decode(b, N).dense(N).astype(np.float64)
        for b, w in zip(encoded, weights, strict=True)
    )
    np.testing.assert_allclose(acc, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_wrong_length_is_rejected(x, spec):
    codec = get_codec(spec)
    blob = codec.encode(x, np.random.default_rng(0))
    with pytest.raises(ValueError, match=f"update has {N} entries, the adapter has {N + 1}"):
        codec.decode(blob, N + 1)
    with pytest.raises(ValueError):
        codec.decode(blob[:-1], N)
    with pytest.raises(ValueError, match=r"trailing bytes|expected"):
        codec.decode(blob + b"\0", N)


@pytest.mark.parametrize("spec", ["dense", "topk:0.05", "int8"])
def test_non_finite_values_are_rejected(x, spec):
    codec = get_codec(spec)
    blob = bytearray(codec.encode(x, np.random.default_rng(0)))
    # Overwrite the last float32 (a value or, for int8, a scale) with NaN.
    at = len(blob) - 4 if spec != "int8" else 10
    blob[at : at + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.decode(bytes(blob), N)


def test_codec_mismatch_is_rejected(x):
    blob = get_codec("dense").encode(x, np.random.default_rng(0))
    with pytest.raises(ValueError, match="the run uses 'int8'"):
        get_codec("int8").decode(blob, N)


def test_unknown_codec_lists_the_known_ones(run_config):
    values = {**run_config.model_dump(by_alias=True), "codec": "zip"}
    with pytest.raises(ConfigError, match=r"run config:codec: .*unknown codec 'zip'; known: dense"):
        RunConfig.from_user_config(values, source="run config")


@pytest.mark.parametrize("spec", ["topk:0", "topk:1.5", "topk:-0.1", "topk-int8:x", "topk"])
def test_topk_fraction_outside_zero_one_is_refused(run_config, spec):
    values = {**run_config.model_dump(by_alias=True), "codec": spec}
    with pytest.raises(ConfigError, match=r"run config:codec: .*(fraction|needs)"):
        RunConfig.from_user_config(values, source="run config")


def test_residual_survives_and_corruption_is_refused(tmp_path, x):
    codec = get_codec("topk:0.05")
    feedback = ErrorFeedback(tmp_path / "residual.bin", codec, "layout1", N)
    np.testing.assert_array_equal(feedback.load(), np.zeros(N))
    feedback.save(x)
    np.testing.assert_array_equal(feedback.load(), x)
    raw = bytearray(feedback.path.read_bytes())
    raw[-3] ^= 0xFF
    feedback.path.write_bytes(bytes(raw))
    with pytest.raises(ResidualError, match="corrupted residual"):
        feedback.load()
    feedback.path.write_bytes(b"\x01")
    with pytest.raises(ResidualError, match="unreadable residual"):
        feedback.load()
    ErrorFeedback(tmp_path / "r2.bin", codec, "layout1", N).save(x)
    with pytest.raises(ResidualError, match="this run uses 'int8'"):
        ErrorFeedback(tmp_path / "r2.bin", get_codec("int8"), "layout1", N).load()
