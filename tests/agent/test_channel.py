"""The agent's channel against hostile peers: every frame that is not one is a
ChannelError naming what is wrong, raised before anything it announces is read, and a
peer that stalls or hangs up is an error within the timeout, never a hang."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedciuic import __version__
from fedciuic.agent import channel
from fedciuic.agent.channel import (
    FRAME_MAGIC,
    MAX_ARRAYS,
    MAX_HEADER,
    MAX_ITEMS,
    MAX_NAME,
    MAX_RECORDS,
    PROTOCOL,
    WIRE_DTYPES,
    ChannelError,
    Frame,
    ask,
    bind,
    check_socket,
    connect,
    encode,
    mismatch,
    receive,
    send,
)

PREFIX = struct.Struct(">4sIQ")
NOBODY = 65534


@pytest.fixture(autouse=True)
def _short_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read after a frame's prefix waits 1 s, not 30: a reader that wrongly goes on
    reading what it should have refused fails fast (with another message)."""
    monkeypatch.setattr(channel, "IO_TIMEOUT", 1.0)


def header(**changes: Any) -> dict[str, Any]:
    """A valid frame header, with ``changes``; a change to "DROP" removes
    the key."""
    value: dict[str, Any] = {
        "protocol": PROTOCOL,
        "fedciuic": __version__,
        "meta": {},
        "config": {},
        "metrics": {},
        "arrays": None,
    }
    for key, new in changes.items():
        if new == "DROP":
            del value[key]
        else:
            value[key] = new
    return value


def raw(
    head: dict[str, Any] | bytes,
    body: bytes = b"",
    *,
    magic: bytes = FRAME_MAGIC,
    header_size: int | None = None,
    body_size: int | None = None,
) -> bytes:
    """A frame as bytes, its prefix saying what the caller says."""
    text = head if isinstance(head, bytes) else json.dumps(head).encode()
    size = len(text) if header_size is None else header_size
    prefix = PREFIX.pack(magic, size, len(body) if body_size is None else body_size)
    return prefix + text + body


def deliver(
    data: bytes, *, close: bool = False, max_body: int = channel.MAX_BODY, wait: float = 2.0
) -> Frame:
    """``data`` written by a peer (which then hangs up when ``close``), read by
    :func:`receive`."""
    ours, theirs = socket.socketpair()

    def write() -> None:
        with contextlib.suppress(OSError):
            ours.sendall(data)
            if close:
                ours.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        return receive(theirs, max_body=max_body, wait=wait)
    finally:
        theirs.close()
        writer.join(5)
        ours.close()


def refused(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(ChannelError) as caught:
        deliver(data, **kwargs)
    return str(caught.value)


def roundtrip(frame: Frame) -> Frame:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        writer = threading.Thread(target=send, args=(ours, frame), daemon=True)
        writer.start()
        got = receive(theirs, wait=5)
        writer.join(5)
    return got


# -- what crosses intact ----------------------------------------------------------------


def test_a_frame_of_every_kind_of_value_crosses_intact():
    arrays: dict[str, np.ndarray] = {
        f"a-{np.dtype(kind).name}": np.arange(6).reshape(2, 3).astype(kind)
        for kind in sorted(WIRE_DTYPES)
    }
    arrays |= {
        "scalar": np.array(3.5, dtype=np.float64),  # 0-d
        "empty": np.zeros((0, 4), dtype=np.float32),
        "empty-1d": np.zeros(0, dtype=np.uint8),
        "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],  # not contiguous
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    }
    frame = Frame(
        meta={"kind": "train", "flower-run": 2**63 - 1},
        config={
            "config": {
                "bytes": b"\x00\xff" * 10,
                "no-bytes": b"",
                "yes": True,
                "no": False,
                "int": -(2**53),
                "float": 0.1,
                "whole-float": 2.0,
                "text": "ü \n \"quoted\" {'b64': 'x'}",
                "empty": "",
            },
            "other": {},
        },
        metrics={"metrics": {"n": 7, "loss": 1.25, "big": 1e300, "neg": -3}},
        arrays=arrays,
    )
    got = roundtrip(frame)
    assert got.meta == frame.meta and got.peer == (PROTOCOL, __version__)
    assert got.config == frame.config and got.metrics == frame.metrics
    # Types, not only values: True is no 1, 2.0 stays a float, bytes stay bytes.
    for name, value in frame.config["config"].items():
        assert type(got.config["config"][name]) is type(value), name
    assert type(got.metrics["metrics"]["n"]) is int
    assert got.arrays is not None and list(got.arrays) == list(arrays)
    for name, array in arrays.items():
        assert got.arrays[name].dtype == array.dtype, name
        assert got.arrays[name].shape == array.shape, name
        np.testing.assert_array_equal(got.arrays[name], array)


def test_no_arrays_and_an_empty_set_of_arrays_stay_distinct():
    assert roundtrip(Frame(meta={"kind": "hello"})).arrays is None
    assert roundtrip(Frame(arrays={})).arrays == {}
    assert roundtrip(Frame(arrays={"e": np.zeros(0, np.float32)})).arrays is not None


def test_an_answers_error_is_its_error_field():
    assert Frame(meta={"error": "no"}).error == "no"
    assert Frame().error == ""
    assert Frame(meta={"error": 3}).error == "3"


# -- hostile frames -----------------------------------------------------------------------

ARRAY = [["a", "<f4", [4]]]  # 16 bytes

HOSTILE = [
    pytest.param(raw(header(), magic=b"HTTP"), "bad magic", id="bad-magic"),
    pytest.param(raw(b"{not json"), "frame header: not JSON", id="not-json"),
    pytest.param(raw(b""), "frame header: not JSON", id="empty-header"),
    pytest.param(raw(b"\xff\xfe{}"), "frame header: not JSON", id="not-utf8"),
    pytest.param(raw(b"[1, 2]"), "a JSON object expected", id="json-list"),
    pytest.param(raw(b'"text"'), "a JSON object expected", id="json-string"),
    pytest.param(
        raw(json.dumps(header()).replace("{}", '{"c": {"x": NaN}}', 1).encode()),
        "NaN is not a number",
        id="nan-constant",
    ),
    pytest.param(
        raw(json.dumps(header()).replace("{}", '{"c": {"x": -Infinity}}', 1).encode()),
        "-Infinity is not a number",
        id="infinity-constant",
    ),
    pytest.param(
        raw(json.dumps(header()).replace('"config": {}', '"config": {"c": {"x": 1e400}}').encode()),
        "not a finite number",
        id="overflowing-float",
    ),
    pytest.param(
        raw(
            json.dumps(header())
            .replace('"metrics": {}', '"metrics": {"m": {"x": -1e999}}')
            .encode()
        ),
        "not a finite number",
        id="overflowing-metric",
    ),
    pytest.param(raw(header(metrics="DROP")), "frame header: keys", id="missing-key"),
    pytest.param(raw(header(extra=1)), "frame header: keys", id="extra-key"),
    pytest.param(raw(header(protocol="DROP")), "protocol (int) and fedciuic", id="no-protocol"),
    pytest.param(raw(header(protocol=True)), "protocol (int) and fedciuic", id="bool-protocol"),
    pytest.param(raw(header(protocol=2.0)), "protocol (int) and fedciuic", id="float-protocol"),
    pytest.param(raw(header(fedciuic=1)), "protocol (int) and fedciuic", id="int-version"),
    pytest.param(raw(header(fedciuic="9" * 65)), "protocol (int) and fedciuic", id="long-version"),
    pytest.param(raw(header(meta=[])), "frame.meta: an object of at most", id="meta-list"),
    pytest.param(raw(header(config=[])), "config: an object of at most", id="config-list"),
    pytest.param(raw(header(config={"c": 1})), "config.c: an object of at most", id="record-int"),
    pytest.param(
        raw(header(config={"c": {"k": [1, 2]}})), "config.c.k: a list is not a scalar", id="list"
    ),
    pytest.param(
        raw(header(config={"c": {"k": None}})), "config.c.k: a NoneType is not", id="null"
    ),
    pytest.param(
        raw(header(config={"c": {"k": {"a": 1}}})),
        "config.c.k: an object other than {'b64': ...}",
        id="nested-object",
    ),
    pytest.param(
        raw(header(config={"c": {"k": {"b64": "AA==", "more": 1}}})),
        "config.c.k: an object other than",
        id="b64-with-more",
    ),
    pytest.param(
        raw(header(config={"c": {"k": {"b64": 5}}})),
        "config.c.k: an object other than",
        id="b64-not-text",
    ),
    pytest.param(
        raw(header(config={"c": {"k": {"b64": "!!not base64!!"}}})),
        "config.c.k: not base64",
        id="bad-base64",
    ),
    pytest.param(
        raw(header(config={"c": {"k": {"b64": "AAA"}}})), "config.c.k: not base64", id="b64-pad"
    ),
    pytest.param(raw(header(meta={"kind": [1]})), "frame.meta.kind: a list", id="meta-list-value"),
    pytest.param(
        raw(header(metrics={"m": {"x": True}})), "metrics.m.x: a number expected", id="bool-metric"
    ),
    pytest.param(
        raw(header(metrics={"m": {"x": "1"}})), "metrics.m.x: a number expected", id="str-metric"
    ),
    pytest.param(
        raw(header(metrics={"m": {"x": {"b64": "AA=="}}})),
        "metrics.m.x: a number expected",
        id="bytes-metric",
    ),
    pytest.param(
        raw(header(config={"": {}})), f"config: a name of 1 to {MAX_NAME}", id="empty-name"
    ),
    pytest.param(
        raw(header(config={"c": {"k" * (MAX_NAME + 1): 1}})),
        f"config.c: a name of 1 to {MAX_NAME}",
        id="long-name",
    ),
    pytest.param(
        raw(header(config={f"r{i}": {} for i in range(MAX_RECORDS + 1)})),
        f"config: an object of at most {MAX_RECORDS} records",
        id="too-many-records",
    ),
    pytest.param(
        raw(header(metrics={f"r{i}": {} for i in range(MAX_RECORDS + 1)})),
        f"metrics: an object of at most {MAX_RECORDS} records",
        id="too-many-metric-records",
    ),
    pytest.param(
        raw(header(config={"c": {f"k{i}": i for i in range(MAX_ITEMS + 1)}})),
        f"config.c: an object of at most {MAX_ITEMS} items",
        id="too-many-items",
    ),
    pytest.param(
        raw(header(meta={f"k{i}": i for i in range(MAX_ITEMS + 1)})),
        f"frame.meta: an object of at most {MAX_ITEMS} items",
        id="too-many-meta-items",
    ),
    # Arrays: their layout against the body the prefix announced.
    pytest.param(
        raw(header(arrays=ARRAY), bytes(15)), "add up to 16 bytes, the body has 15", id="short"
    ),
    pytest.param(
        raw(header(arrays=ARRAY), bytes(17)), "add up to 16 bytes, the body has 17", id="long"
    ),
    pytest.param(raw(header(), bytes(4)), "4 body bytes and no arrays", id="body-no-arrays"),
    pytest.param(raw(header(arrays={})), "arrays: a list of at most", id="arrays-object"),
    pytest.param(
        raw(header(arrays=[["a", "<f4", [1]]] * 2 + [["b", "<f4", [1]]]), bytes(12)),
        "arrays: 'a' twice",
        id="duplicate-name",
    ),
    pytest.param(
        raw(header(arrays=[["a", "|O", [2]]]), bytes(16)), "dtype '|O' is not one of", id="object"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<U4", [1]]]), bytes(16)), "dtype '<U4' is not one of", id="str"
    ),
    pytest.param(
        raw(header(arrays=[["a", ">f4", [1]]]), bytes(4)), "dtype '>f4' is not one of", id="big-end"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<c16", [1]]]), bytes(16)), "dtype '<c16' is not", id="complex"
    ),
    pytest.param(
        raw(header(arrays=[["a", "V8", [1]]]), bytes(8)), "dtype 'V8' is not one of", id="void"
    ),
    pytest.param(
        raw(header(arrays=[["a", ["<f4"], [1]]]), bytes(4)), "arrays.a: dtype", id="list-dtype"
    ),
    pytest.param(
        raw(header(arrays=[["a", {"x": 1}, [1]]]), bytes(4)), "arrays.a: dtype", id="object-dtype"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<f4", [-1]]]), b""), "arrays.a: a shape of at most 8", id="neg"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<f4", [1.0]]]), bytes(4)), "arrays.a: a shape", id="float-dim"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<f4", [True]]]), bytes(4)), "arrays.a: a shape", id="bool-dim"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<f4", [1] * 9]]), bytes(4)), "arrays.a: a shape", id="9-dims"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<f4", 4]]), bytes(16)), "arrays.a: a shape", id="shape-int"
    ),
    pytest.param(
        raw(header(arrays=[["a", "<f4"]]), bytes(4)), "each entry is [name, dtype, shape]", id="2"
    ),
    pytest.param(raw(header(arrays=[None])), "each entry is [name, dtype, shape]", id="null-entry"),
    pytest.param(raw(header(arrays=[[5, "<f4", [1]]]), bytes(4)), "arrays: a name", id="int-name"),
    pytest.param(
        raw(header(arrays=[[f"a{i}", "<f4", [0]] for i in range(MAX_ARRAYS + 1)])),
        f"arrays: a list of at most {MAX_ARRAYS}",
        id="too-many-arrays",
    ),
]


@pytest.mark.parametrize(("data", "says"), HOSTILE)
def test_a_hostile_frame_is_refused_naming_what_is_wrong(data, says):
    began = time.monotonic()
    reason = refused(data)
    assert says in reason
    assert time.monotonic() - began < 0.9  # refused on what it read, not after a timeout


@pytest.mark.parametrize(
    ("prefix", "says"),
    [
        pytest.param(
            PREFIX.pack(FRAME_MAGIC, MAX_HEADER + 1, 0),
            f"frame header of {MAX_HEADER + 1} bytes (at most {MAX_HEADER})",
            id="header",
        ),
        pytest.param(
            PREFIX.pack(FRAME_MAGIC, 2**32 - 1, 0),
            f"frame header of {2**32 - 1} bytes",
            id="max-header",
        ),
        pytest.param(
            PREFIX.pack(FRAME_MAGIC, 10, 1001), "frame body of 1001 bytes (at most 1000)", id="body"
        ),
        pytest.param(
            PREFIX.pack(FRAME_MAGIC, 10, 2**64 - 1),
            f"frame body of {2**64 - 1} bytes",
            id="max-body",
        ),
    ],
)
def test_an_announced_size_over_its_limit_is_refused_before_it_is_read(prefix, says):
    """Only the prefix is sent and the peer stays connected: a reader that went on to
    read the header would wait for it (and fail otherwise, after IO_TIMEOUT)."""
    began = time.monotonic()
    assert says in refused(prefix, max_body=1000)
    assert time.monotonic() - began < 0.5


def test_the_default_body_limit_refuses_a_body_over_two_gib():
    assert "frame body of" in refused(PREFIX.pack(FRAME_MAGIC, 2, channel.MAX_BODY + 1) + b"{}")


def test_a_body_within_max_body_is_read():
    arrays = {"a": np.zeros(250, np.float32)}
    head, body = encode(Frame(arrays=arrays))
    got = deliver(head + b"".join(bytes(b) for b in body), max_body=1000)
    assert got.arrays is not None and got.arrays["a"].shape == (250,)
    assert "frame body of 1000 bytes (at most 999)" in refused(
        head + b"".join(bytes(b) for b in body), max_body=999
    )


@pytest.mark.parametrize(
    ("data", "says"),
    [
        pytest.param(
            b"", "the connection closed in the frame prefix (0 of 16 bytes)", id="nothing"
        ),
        pytest.param(
            FRAME_MAGIC + b"\x00", "closed in the frame prefix (5 of 16 bytes)", id="prefix"
        ),
        pytest.param(
            PREFIX.pack(FRAME_MAGIC, 100, 0) + b'{"protocol"',
            "the connection closed in the frame header (11 of 100 bytes)",
            id="header",
        ),
        pytest.param(
            raw(header(arrays=[["first", "<f4", [1]], ["second", "<f8", [2]]]), bytes(4 + 16))[:-8],
            "the connection closed in the array second (8 of 16 bytes)",
            id="body",
        ),
    ],
)
def test_a_peer_that_hangs_up_mid_frame_is_named_where(data, says):
    assert says in refused(data, close=True)


def test_a_peer_that_sends_nothing_is_an_error_within_the_wait():
    began = time.monotonic()
    assert "no answer within 0.3s (frame prefix)" in refused(b"", wait=0.3)
    assert time.monotonic() - began < 1.5


def test_a_peer_that_stalls_mid_frame_is_an_error_within_the_io_timeout(monkeypatch):
    monkeypatch.setattr(channel, "IO_TIMEOUT", 0.3)
    began = time.monotonic()
    stalled_header = PREFIX.pack(FRAME_MAGIC, 100, 0) + b'{"prot'
    assert "no answer within 0.3s (frame header)" in refused(stalled_header, wait=5)
    stalled_body = raw(header(arrays=ARRAY), bytes(16))[:-3]
    assert "no answer within 0.3s (array a)" in refused(stalled_body, wait=5)
    assert time.monotonic() - began < 3


def test_a_peer_of_another_protocol_is_refused_in_one_line_naming_both_versions():
    reason = refused(raw(header(protocol=PROTOCOL + 1, fedciuic="9.8.7")))
    assert "\n" not in reason
    assert f"speaks protocol {PROTOCOL + 1} (fedciuic 9.8.7)" in reason
    assert f"this side speaks {PROTOCOL} (fedciuic {__version__})" in reason
    assert "install the same fedciuic version" in reason
    # A peer of another protocol may lay out the rest otherwise: it is still named.
    future = raw({"protocol": 7, "fedciuic": "7.0", "payload": [1, 2]})
    assert "speaks protocol 7 (fedciuic 7.0)" in refused(future)
    # The old pickled protocol 1 (fedciuic trainer).
    assert "speaks protocol 1 (fedciuic 0.0.1)" in refused(
        raw(header(protocol=1, fedciuic="0.0.1"))
    )
    assert "\n" not in mismatch((1, "x"), "the relay")


# -- what encode refuses --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        pytest.param(
            Frame(config={"c": {"x": float("nan")}}), "c.x: nan is not a finite", id="nan"
        ),
        pytest.param(
            Frame(metrics={"m": {"x": float("inf")}}), "m.x: inf is not a finite", id="inf"
        ),
        pytest.param(Frame(meta={"x": -float("inf")}), "x: -inf is not a finite", id="meta-inf"),
        pytest.param(Frame(config={"c": {"x": [1, 2]}}), "c.x: a list cannot cross", id="list"),  # type: ignore[dict-item]
        pytest.param(Frame(config={"c": {"x": None}}), "c.x: a NoneType cannot", id="none"),  # type: ignore[dict-item]
        pytest.param(Frame(config={"c": {"x": {"a": 1}}}), "c.x: a dict cannot", id="dict"),  # type: ignore[dict-item]
        pytest.param(Frame(config={"c": {"x": np.int64(1)}}), "c.x: a int64 cannot", id="np-int"),  # type: ignore[dict-item]
        pytest.param(
            Frame(metrics={"m": {"x": np.float32(1)}}),  # type: ignore[dict-item]
            "m.x: a float32 cannot",
            id="np-float32",
        ),
        pytest.param(Frame(meta={"x": bytearray(b"a")}), "x: a bytearray cannot", id="bytearray"),  # type: ignore[dict-item]
        pytest.param(Frame(metrics={"m": {"x": True}}), "m.x: a bool cannot", id="bool-metric"),
        pytest.param(
            Frame(arrays={"o": np.array([object()], dtype=object)}),
            "arrays.o: dtype object cannot cross",
            id="object-array",
        ),
    ],
)
def test_encode_refuses_what_cannot_cross(frame, says):
    with pytest.raises(ChannelError, match=r"cannot cross|not a finite") as caught:
        encode(frame)
    assert says in str(caught.value)


def test_encode_refuses_a_header_over_max_header():
    with pytest.raises(ChannelError, match=r"frame header of \d+ bytes \(at most"):
        encode(Frame(config={"c": {"x": "y" * MAX_HEADER}}))


# -- the socket a relay connects to ---------------------------------------------------------


@contextlib.contextmanager
def listening(path: Path) -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with server:
        bind(server, path)
        server.listen(4)
        yield server


def own_folder(tmp_path: Path, mode: int = 0o711) -> Path:
    folder = tmp_path / "agent"
    folder.mkdir()
    folder.chmod(mode)
    return folder


def test_check_socket_accepts_a_socket_in_a_folder_only_its_owner_may_write(tmp_path):
    path = own_folder(tmp_path) / "agent.sock"
    with listening(path):
        assert check_socket(path).st_uid == os.getuid()


def test_check_socket_refuses_a_path_with_nothing_there(tmp_path):
    with pytest.raises(ChannelError, match=r"no agent socket at .*agent\.sock"):
        check_socket(own_folder(tmp_path) / "agent.sock")


def test_check_socket_refuses_a_regular_file(tmp_path):
    path = own_folder(tmp_path) / "agent.sock"
    path.write_text("not a socket")
    with pytest.raises(ChannelError, match="is not a socket"):
        check_socket(path)


def test_check_socket_refuses_a_symlink_to_a_socket(tmp_path):
    real = own_folder(tmp_path) / "real.sock"
    link = real.parent / "agent.sock"
    with listening(real):
        link.symlink_to(real)
        with pytest.raises(ChannelError, match=f"{link} is not a socket"):
            check_socket(link)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_check_socket_refuses_a_socket_in_a_folder_others_may_write(tmp_path, mode):
    path = own_folder(tmp_path) / "agent.sock"
    with listening(path):
        path.parent.chmod(mode)
        with pytest.raises(ChannelError, match="others may write to it"):
            check_socket(path)


def test_check_socket_refuses_a_socket_in_a_folder_of_another_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip(f"chown to another user needs root; this test runs as uid {os.geteuid()}")
    path = own_folder(tmp_path) / "agent.sock"
    with listening(path):
        os.chown(path.parent, NOBODY, -1)
        with pytest.raises(
            ChannelError, match=f"not owned by the socket's owner \\(uid {os.getuid()}\\)"
        ):
            check_socket(path)


def test_connect_refuses_a_socket_served_by_another_user_than_its_owner(tmp_path):
    """A socket file (and folder) of uid N whose listener runs as another uid: someone
    else's process answers on it."""
    if os.geteuid() != 0:
        pytest.skip(f"chown to another user needs root; this test runs as uid {os.geteuid()}")
    path = own_folder(tmp_path) / "agent.sock"
    with listening(path):
        os.chown(path.parent, NOBODY, -1)
        os.chown(path, NOBODY, -1)
        with pytest.raises(
            ChannelError, match=f"runs as uid 0, the socket belongs to uid {NOBODY}"
        ):
            connect(path, 1.0)


def test_connect_to_a_path_with_no_socket_fails_within_its_timeout_naming_the_path(tmp_path):
    path = own_folder(tmp_path) / "agent.sock"
    began = time.monotonic()
    with pytest.raises(ChannelError) as caught:
        connect(path, 0.5)
    assert 0.4 < time.monotonic() - began < 2.0
    assert str(caught.value).startswith(f"no agent answers on {path} within 0.5s")
    began = time.monotonic()
    with pytest.raises(ChannelError, match=f"no agent answers on {path} within 0.3s"):
        ask(path, Frame(meta={"kind": "hello"}), timeout=5, connect_timeout=0.3)
    assert time.monotonic() - began < 2.0


def test_connect_to_a_socket_nobody_listens_on_fails_within_its_timeout(tmp_path):
    path = own_folder(tmp_path) / "agent.sock"
    with listening(path):
        pass  # closed: the socket file stays, nobody accepts
    began = time.monotonic()
    with pytest.raises(ChannelError, match=f"no agent answers on {path} within 0.5s"):
        connect(path, 0.5)
    assert time.monotonic() - began < 2.0


def test_ask_reaches_an_agent_on_a_path_longer_than_a_socket_path_may_be(tmp_path):
    folder = own_folder(tmp_path) / ("x" * 60) / ("y" * 60)
    folder.mkdir(parents=True, mode=0o711)
    path = folder / "agent.sock"
    assert len(os.fsencode(path)) > 107

    with listening(path) as server:

        def agent() -> None:
            client, _ = server.accept()
            with client:
                request = receive(client, wait=5)
                send(client, Frame(config={"status": {"kind": str(request.meta["kind"])}}))

        thread = threading.Thread(target=agent, daemon=True)
        thread.start()
        answer = ask(path, Frame(meta={"kind": "hello"}), timeout=5, connect_timeout=2)
        thread.join(5)
    assert answer.config == {"status": {"kind": "hello"}} and answer.error == ""


def test_ask_returns_a_refusal_sent_before_the_request_was_read(tmp_path):
    """An agent that refuses a request (too large) before reading it: the relay still
    reads its one-line answer instead of failing on the write."""
    path = own_folder(tmp_path) / "agent.sock"
    with listening(path) as server:

        def agent() -> None:
            client, _ = server.accept()
            with client:
                with contextlib.suppress(ChannelError):
                    receive(client, max_body=10, wait=5)
                send(client, Frame(meta={"error": "too large"}))

        thread = threading.Thread(target=agent, daemon=True)
        thread.start()
        big = Frame(arrays={"a": np.zeros(1 << 20, np.uint8)})
        answer = ask(path, big, timeout=5, connect_timeout=2)
        thread.join(5)
    assert answer.error == "too large"
