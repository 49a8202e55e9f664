"""Top-k index coding (format 2): round trips near log2 C(n, k) for spread and
clustered indices, the value bodies, and malformed or oversized payloads refused
before anything large is allocated."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from fedciuic.compression import CodecFamily, get_codec
from fedciuic.compression import indices as coding
from fedciuic.compression.codecs import CODECS, HEADER, UPDATE_MAGIC, top_k
from fedciuic.compression.errors import MalformedUpdate

N = 200_000
RNG = np.random.default_rng(7)
BIG = 2_000_000  # an adapter's size, where the index block's fixed bytes do not count


def uniform(k: int) -> np.ndarray:
    return np.sort(RNG.choice(BIG, k, replace=False))


def runs(k: int) -> np.ndarray:
    """A few long runs of neighbours: the gaps are 0, then a jump."""
    starts = np.sort(RNG.choice(BIG - 500, k // 400 + 1, replace=False))
    return np.unique((starts[:, None] + np.arange(500)).ravel())[:k]


def pairs(k: int) -> np.ndarray:
    base = np.sort(RNG.choice(BIG // 2, k // 2, replace=False)) * 2
    return np.unique(np.concatenate([base, base + 1]))


def triples(k: int) -> np.ndarray:
    base = np.sort(RNG.choice(BIG // 3, k // 3, replace=False)) * 3
    return np.unique(np.concatenate([base, base + 1, base + 2]))


def one_tensor(k: int) -> np.ndarray:
    """Everything kept falls in one part (a tensor of the adapter), then nothing."""
    return np.sort(RNG.choice(max(BIG // 20, 2 * k), k, replace=False))


def mixed(k: int) -> np.ndarray:
    """Half packed in 1 % of the entries, half spread over the rest."""
    part = max(BIG // 100, 2 * k)
    dense = RNG.choice(part, k // 2, replace=False)
    spread = RNG.choice(np.arange(part, BIG), k - k // 2, replace=False)
    return np.sort(np.concatenate([dense, spread]))


LAYOUTS = [uniform, runs, pairs, triples, one_tensor, mixed]
DENSITIES = [0.0005, 0.005, 0.015, 0.05, 0.2]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("density", DENSITIES)
def test_indices_round_trip_within_5_percent_of_the_entropy_bound(layout, density):
    indices = layout(int(BIG * density))
    blob = coding.encode(indices)
    got, used = coding.decode(memoryview(blob), indices.size, BIG)
    np.testing.assert_array_equal(got, indices)
    assert used == len(blob)
    efficiency = coding.bound_bits(BIG, indices.size) / (8 * len(blob))
    assert efficiency >= 0.95, f"{layout.__name__} at {density}: {efficiency:.3f}"


@pytest.mark.parametrize("indices", [[0], [N - 1], [0, N - 1], list(range(N))])
def test_edge_index_sets_round_trip(indices):
    indices = np.array(indices, np.int64)
    got, _ = coding.decode(memoryview(coding.encode(indices)), indices.size, N)
    np.testing.assert_array_equal(got, indices)


def test_codec_families_are_the_registry():
    assert set(CodecFamily.__args__) == set(CODECS)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "spec", ["topk:0.01", "topk-int8:0.015", "topk-int4:0.02", "topk-sign:0.1"]
)
@pytest.mark.parametrize("distribution", ["normal", "flat", "heavy", "clustered"])
def test_topk_codecs_keep_the_largest_and_bound_their_error(spec, distribution):
    rng = np.random.default_rng(3)
    x = {
        "normal": lambda: rng.standard_normal(N),
        "flat": lambda: rng.uniform(-1, 1, N),  # a DP delta: bounded, kurtosis 1.8
        "heavy": lambda: rng.standard_t(2, N),
        "clustered": lambda: (
            np.where(np.arange(N) % 5000 < 300, 10.0, 0.01) * rng.standard_normal(N)
        ),
    }[distribution]().astype(np.float32)
    codec = get_codec(spec)
    got = codec.decode(codec.encode(x, rng), N)
    k = codec.k(N)
    assert got.indices is not None and got.indices.size == k
    threshold = np.sort(np.abs(x))[-k]
    assert np.all(np.abs(x[got.indices]) >= threshold)
    kept = x[got.indices]
    err = np.abs(got.values - kept)
    scale = np.abs(kept).max()
    bound = {"topk": 0.0, "topk-int8": scale / 127, "topk-int4": scale / 7, "topk-sign": 2 * scale}
    assert err.max() <= bound[codec.family] * (1 + 1e-6)
    if codec.family == "topk-sign":
        assert np.all(np.sign(got.values) == np.where(kept >= 0, 1, -1))


def test_int4_stochastic_rounding_is_unbiased():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3000).astype(np.float32)
    codec = get_codec("topk-int4:1")
    mean = np.mean(
        [codec.decode(codec.encode(x, rng), x.size).dense(x.size) for _ in range(300)], 0
    )
    assert np.abs(mean - x).max() < 0.25 * np.abs(x).max() / 7


def test_ties_at_the_threshold_still_keep_exactly_k():
    x = np.ones(1000, np.float32)
    x[:10] = 5
    got = top_k(x, 50)
    assert got.size == 50 and set(range(10)) <= set(got.tolist())
    big = np.zeros(N, np.float32)  # the sampled threshold path, all ties
    assert top_k(big, 123).tolist() == list(range(123))


def test_a_delta_with_nan_is_refused_before_encoding():
    x = np.zeros(100, np.float32)
    x[3] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("topk-int8:0.1").encode(x, np.random.default_rng(0))


INDEX_AT = HEADER.size + 4  # the index block: after the header and k


def _topk_update() -> bytes:
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    return get_codec("topk:0.05").encode(x, np.random.default_rng(0))


def test_truncations_and_byte_flips_give_a_malformed_update_or_a_valid_one():
    codec = get_codec("topk-int4:0.01")
    blob = codec.encode(np.random.default_rng(2).standard_normal(N).astype(np.float32), RNG)
    for cut in range(0, len(blob), 97):
        with pytest.raises(MalformedUpdate):
            codec.decode(blob[:cut], N)
    rng = np.random.default_rng(5)
    for _ in range(300):
        bad = bytearray(blob)
        at = int(rng.integers(HEADER.size, len(bad)))
        bad[at] ^= 1 << int(rng.integers(8))
        try:
            got = codec.decode(bytes(bad), N)
        except MalformedUpdate:
            continue
        assert got.indices is not None and got.indices.size == codec.k(N)
        assert np.all(np.diff(got.indices) > 0) and got.indices[-1] < N


def test_a_block_parameter_with_unknown_bits_is_refused():
    blob = _topk_update()
    bad = bytearray(blob)
    bad[INDEX_AT + 4] = 0x40
    with pytest.raises(MalformedUpdate, match="unknown bits"):
        get_codec("topk:0.05").decode(bytes(bad), N)


def test_an_index_past_the_end_is_refused():
    # One kept index per block of 256 entries: declare n smaller than they reach.
    indices = np.arange(0, 512 * 10, 512)
    body = struct.pack("<I", 10) + coding.encode(indices)
    with pytest.raises(MalformedUpdate, match="out of range"):
        coding.decode(memoryview(body[4:]), 10, 4000)


def test_a_huge_declared_high_stream_is_refused_before_allocating():
    blob = _topk_update()
    bad = bytearray(blob)
    at = INDEX_AT
    bad[at : at + 4] = struct.pack("<I", 0xFFFFFFFF)
    frozen = bytes(bad)
    tracemalloc.start()
    with pytest.raises(MalformedUpdate, match="truncated or malformed"):
        get_codec("topk:0.05").decode(frozen, N)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2**20  # the arrays of k = 10,000 gaps; the declared 4 GiB would be 32 unpacked


def test_a_count_of_coded_indices_other_than_k_is_refused():
    blob = _topk_update()
    at = INDEX_AT
    (high_len,) = struct.unpack_from("<I", blob, at)
    bad = bytearray(blob)
    bad[at : at + 4] = struct.pack("<I", high_len - 1)  # the last unary codes cut off
    with pytest.raises(MalformedUpdate):
        get_codec("topk:0.05").decode(bytes(bad), N)


def test_an_int4_nibble_outside_its_range_is_refused():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    codec = get_codec("topk-int4:0.5")
    blob = bytearray(codec.encode(x, RNG))
    blob[-1] &= 0xF0  # last byte's low nibble 0: the value -8
    with pytest.raises(MalformedUpdate, match="int4"):
        codec.decode(bytes(blob), 1000)


def test_an_unknown_format_version_names_both_versions():
    blob = bytearray(_topk_update())
    blob[3] = 9
    with pytest.raises(MalformedUpdate, match="wire format 9; this fedciuic reads formats 1, 2"):
        get_codec("topk:0.05").decode(bytes(blob), N)


def _v1_gaps(indices: np.ndarray) -> bytes:
    """Format 1's index block, as fedciuic wrote it before format 2."""
    gaps = np.diff(indices, prepend=-1) - 1
    width = max(1, int(gaps.max()).bit_length())
    bits = ((gaps[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return bytes([width]) + np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def test_a_format_1_update_still_decodes():
    x = np.random.default_rng(4).standard_normal(5000).astype(np.float32)
    codec = get_codec("topk:0.05")
    top = top_k(x, codec.k(x.size))
    v1 = HEADER.pack(UPDATE_MAGIC, codec.ident, 1, x.size, 0) + struct.pack("<I", top.size)
    got = codec.decode(v1 + _v1_gaps(top) + x[top].tobytes(), x.size)
    np.testing.assert_array_equal(
        got.dense(x.size), get_codec("topk:0.05").decode(codec.encode(x, RNG), x.size).dense(x.size)
    )
