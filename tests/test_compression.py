"""Codecs, their error bounds, error feedback and sparse aggregation."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from fedciuic.compression import ErrorFeedback, compress_with_feedback, get_codec
from fedciuic.compression.errors import MalformedUpdate, ResidualError
from fedciuic.compression.values import CHUNK
from fedciuic.config import RunConfig
from fedciuic.errors import ConfigError

SPECS = [
    "dense",
    "int8",
    "int4",
    "int2",
    "sign",
    "topk:0.05",
    "topk-int8:0.05",
    "topk-int4:0.05",
    "topk-sign:0.05",
]
#: The dense stochastic-rounding codecs and their largest level (values -L..L).
LEVELS = {"int8": 127, "int4": 7, "int2": 1}
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


def step_of(x: np.ndarray, spec: str) -> np.ndarray:
    """Each entry's quantisation step, as the encoder computes it (float32)."""
    return (chunk_max(x).astype(np.float32) / np.float32(LEVELS[spec])).astype(np.float32)


@pytest.mark.parametrize("spec", LEVELS)
def test_dense_quantised_error_is_below_one_step(x, spec):
    codec = get_codec(spec)
    sent = codec.decode(codec.encode(x, np.random.default_rng(0)), N).dense(N)
    assert np.all(np.abs(sent - x) <= step_of(x, spec) * (1 + 1e-6))  # documented bound
    assert np.allclose(sent / step_of(x, spec), np.round(sent / step_of(x, spec)), atol=1e-3)


@pytest.mark.parametrize("spec", LEVELS)
def test_dense_stochastic_rounding_is_unbiased(spec):
    """The mean of M encodings converges to x: each entry rounds to one of its two
    neighbouring levels with the probabilities that make it exact in expectation, so
    its error has mean 0 and variance ``step**2 r (1 - r)`` (r: x's fraction of a step)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(N).astype(np.float32)
    x[5] = 0.0  # on a level: always exact
    codec, m = get_codec(spec), 2000
    sent = np.stack([codec.decode(codec.encode(x, rng), N).dense(N) for _ in range(m)])
    err = sent.astype(np.float64) - x
    step = step_of(x, spec).astype(np.float64)
    r = x / step - np.floor(x / step)
    variance = step**2 * r * (1 - r)
    assert np.all(err[:, 5] == 0)
    # Per entry, the mean error is within 5 standard errors of 0 ...
    standard_error = np.sqrt(variance / m)
    assert np.all(np.abs(err.mean(0)) <= 5 * standard_error + 1e-7 * step)
    # ... and over all entries no bias shows (a z-score of the summed error) ...
    assert abs(err.mean(0).sum()) <= 5 * np.sqrt(variance.sum() / m)
    # ... while the squared error is what unbiased rounding costs, at most step**2 / 4.
    mse = (err**2).mean(0)
    assert abs(mse.sum() / variance.sum() - 1) < 0.05
    assert np.all(mse <= step**2 / 4 * 1.2 + 1e-12)


@pytest.mark.parametrize("spec", LEVELS)
@pytest.mark.parametrize("n", [1, 3, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_dense_quantised_round_trip_shape_and_size(spec, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    codec = get_codec(spec)
    blob = codec.encode(x, np.random.default_rng(1))
    width = {"int8": 8, "int4": 4, "int2": 2}[spec]
    assert len(blob) == 10 + 4 * -(-n // CHUNK) + -(-n * width // 8)  # docs/compression.md
    got = codec.decode(blob, n)
    assert got.indices is None and got.values.shape == (n,) and got.values.dtype == np.float32
    assert np.all(np.abs(got.dense(n) - x) <= step_of(x, spec) * (1 + 1e-6))


@pytest.mark.parametrize(("spec", "levels"), [("int4", "-7..7"), ("int2", "-1..1")])
def test_a_packed_code_of_zero_or_a_non_zero_pad_is_refused(x, spec, levels):
    codec = get_codec(spec)
    blob = bytearray(codec.encode(x, np.random.default_rng(0)))
    first = 10 + 4 * -(-N // CHUNK)  # the first packed byte
    bad = bytearray(blob)
    bad[first] &= 0xF0 if spec == "int4" else 0xFC  # the first entry's code: 0
    with pytest.raises(MalformedUpdate, match=f"{spec} body holds a value outside {levels}"):
        codec.decode(bytes(bad), N)
    bad = bytearray(blob)
    bad[-1] |= 0x80  # N % 4 == 1: the last byte's top bits are pad
    with pytest.raises(MalformedUpdate, match="non-zero pad"):
        codec.decode(bytes(bad), N)
    with pytest.raises(MalformedUpdate, match=f"{spec} body truncated"):
        codec.decode(bytes(blob[:-1]), N)
    with pytest.raises(MalformedUpdate, match="the run uses 'int8'"):
        get_codec("int8").decode(bytes(blob), N)


@pytest.mark.parametrize("spec", LEVELS)
def test_error_feedback_with_dense_quantisers_delays_nothing_for_long(spec):
    """Over many rounds what was sent plus the last residual is every delta summed, and
    the residual stays below one step of what was encoded: it does not build up."""
    rng = np.random.default_rng(6)
    codec = get_codec(spec)
    residual = np.zeros(N, np.float32)
    total_sent, total_delta = np.zeros(N, np.float64), np.zeros(N, np.float64)
    for _ in range(30):
        delta = rng.uniform(-1, 1, N).astype(np.float32)  # a flat, DP-like delta
        target = delta + residual
        blob, residual = compress_with_feedback(delta, residual, codec, rng)
        total_sent += codec.decode(blob, N).dense(N)
        total_delta += delta
        assert np.all(np.abs(residual) <= step_of(target, spec) * (1 + 1e-6))
    np.testing.assert_allclose(total_sent + residual, total_delta, rtol=0, atol=1e-4)


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


@pytest.mark.parametrize("spec", ["dense", "topk:0.05", "int8", "int4", "int2"])
def test_non_finite_values_are_rejected(x, spec):
    codec = get_codec(spec)
    blob = bytearray(codec.encode(x, np.random.default_rng(0)))
    # Overwrite the last float32 (a value) or, for the quantisers, the first scale with NaN.
    at = 10 if spec in LEVELS else len(blob) - 4
    blob[at : at + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.decode(bytes(blob), N)


def test_codec_mismatch_is_rejected(x):
    blob = get_codec("dense").encode(x, np.random.default_rng(0))
    with pytest.raises(ValueError, match="the run uses 'int8'"):
        get_codec("int8").decode(blob, N)


def test_unknown_codec_lists_the_known_ones(run_config):
    values = {**run_config.flat(), "codec": "zip"}
    with pytest.raises(ConfigError, match=r"run config:codec: .*unknown codec 'zip'; known: dense"):
        RunConfig.from_user_config(values, source="run config")


@pytest.mark.parametrize("spec", ["topk:0", "topk:1.5", "topk:-0.1", "topk-int8:x", "topk"])
def test_topk_fraction_outside_zero_one_is_refused(run_config, spec):
    values = {**run_config.flat(), "codec": spec}
    with pytest.raises(ConfigError, match=r"run config:codec: .*(fraction|needs)"):
        RunConfig.from_user_config(values, source="run config")


def test_a_round_compressed_again_starts_from_the_residual_before_it(tmp_path, x):
    """The file keeps the residual a round left and the one it started from: the same
    round again (its first attempt never committed) starts where the first did."""
    codec, path = get_codec("topk:0.05"), tmp_path / "residual.bin"

    def at(tag: str) -> ErrorFeedback:
        return ErrorFeedback(path, codec, "layout1", N, tag)

    first, second, third = x, 2 * x, 3 * x
    at("run-1-round-1").save(first)
    np.testing.assert_array_equal(at("run-1-round-1").load(), np.zeros(N))  # again: none before
    np.testing.assert_array_equal(at("run-1-round-2").load(), first)
    at("run-1-round-2").save(second)
    np.testing.assert_array_equal(at("run-1-round-2").load(), first)
    at("run-1-round-2").save(third)  # the round once more: what it started from stays
    np.testing.assert_array_equal(at("run-1-round-2").load(), first)
    np.testing.assert_array_equal(at("run-1-round-3").load(), third)
    np.testing.assert_array_equal(at("run-2-round-1").load(), third)  # carried to a new run


def test_a_residual_of_the_untagged_format_is_still_read(tmp_path, x):
    data = x.astype(np.float32).tobytes()
    meta = json.dumps(
        {
            "format": "fedciuic-residual/1",
            "codec": "topk:0.05",
            "layout": "layout1",
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    ).encode()
    path = tmp_path / "residual.bin"
    path.write_bytes(struct.pack("<I", len(meta)) + meta + data)
    feedback = ErrorFeedback(path, get_codec("topk:0.05"), "layout1", N, "run-1-round-1")
    np.testing.assert_array_equal(feedback.load(), x)


def test_a_residual_pair_with_one_digest_is_still_read(tmp_path, x):
    """Format 2 hashed the residual and the one before it as one: a file written then
    still serves either round, and the next save writes the current format."""
    current, previous = x.astype(np.float32), (2 * x).astype(np.float32)
    data = current.tobytes() + previous.tobytes()
    meta = {
        "format": "fedciuic-residual/2",
        "codec": "topk:0.05",
        "layout": "layout1",
        "tag": "run-1-round-2",
        "previous": True,
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    path = tmp_path / "residual.bin"
    header = json.dumps(meta).encode()
    path.write_bytes(struct.pack("<I", len(header)) + header + data)
    codec = get_codec("topk:0.05")
    np.testing.assert_array_equal(
        ErrorFeedback(path, codec, "layout1", N, "run-1-round-2").load(), previous
    )
    later = ErrorFeedback(path, codec, "layout1", N, "run-1-round-3")
    np.testing.assert_array_equal(later.load(), current)
    later.save(3 * current)
    assert b"fedciuic-residual/3" in path.read_bytes()[:200]
    np.testing.assert_array_equal(
        ErrorFeedback(path, codec, "layout1", N, "run-1-round-3").load(), current
    )


def test_only_the_residual_a_round_uses_must_be_intact(tmp_path, x):
    """Each residual of the pair has its own digest: a damaged one the round does not use
    is dropped by its save; the damaged one it would use is refused."""
    codec, path = get_codec("topk:0.05"), tmp_path / "residual.bin"

    def at(tag: str) -> ErrorFeedback:
        return ErrorFeedback(path, codec, "layout1", N, tag)

    at("run-1-round-1").save(x)
    at("run-1-round-2").save(2 * x)  # the file: 2x (round 2's), then x (before it)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # in x, the residual before round 2
    path.write_bytes(bytes(raw))
    with pytest.raises(ResidualError, match=r"residual\.bin: corrupted residual"):
        at("run-1-round-2").load()  # round 2 again would start from the damaged one
    nxt = at("run-1-round-3")
    np.testing.assert_array_equal(nxt.load(), 2 * x)
    nxt.save(3 * x)
    np.testing.assert_array_equal(at("run-1-round-3").load(), 2 * x)
    raw = bytearray(path.read_bytes())
    at_nan = len(raw) - 4 * (2 * N - 5)  # a value of 3x, round 3's own residual
    raw[at_nan : at_nan + 4] = np.float32("nan").tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ResidualError, match="corrupted residual"):
        at("run-1-round-4").load()


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
    feedback.path.write_bytes(struct.pack("<I", 3) + b"[1]" + x.astype(np.float32).tobytes())
    with pytest.raises(ResidualError, match=r"corrupted residual \(header\)"):
        feedback.load()
    ErrorFeedback(tmp_path / "r2.bin", codec, "layout1", N).save(x)
    with pytest.raises(ResidualError, match="this run uses 'int8'"):
        ErrorFeedback(tmp_path / "r2.bin", get_codec("int8"), "layout1", N).load()


@pytest.mark.parametrize("spec", ["dense", "int8", "topk-int8:0.1"])
def test_a_decoded_updates_norm_and_weighted_sum_span_the_whole_update(spec):
    # Longer than one span, and not a multiple of it: the last, partial span counts too.
    x = np.random.default_rng(5).normal(size=(1 << 17) + 321).astype(np.float32)
    codec = get_codec(spec)
    decoded = codec.decode(codec.encode(x, np.random.default_rng(0)), x.size)
    dense = decoded.dense(x.size).astype(np.float64)
    assert decoded.norm() == pytest.approx(float(np.linalg.norm(dense)), rel=1e-12)
    acc = np.ones(x.size)
    decoded.add_into(acc, 0.5)
    want = np.ones(x.size)
    want += np.float32(0.5) * decoded.dense(x.size)
    assert np.array_equal(acc, want)
