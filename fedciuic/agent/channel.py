"""The region agent's channel: framed JSON and raw array bytes over a Unix socket.

Whoever connects is untrusted code, so nothing that crosses is executed or unpickled:

    FRAME_MAGIC (4) | header length (u32) | body length (u64) | header (JSON) | body

The JSON header holds the versions, the frame's fields, its records and its arrays' (name,
dtype, shape), whose bytes follow in the body. Every limit is checked before anything is
read into memory. One request and one answer per connection. Stdlib and NumPy only: the
relay imports this module.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import socket
import stat
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedciuic import __version__
from fedciuic.errors import FedciuicError

#: Never changes, nor does the prefix: a peer of another protocol is read far enough to
#: name its version.
FRAME_MAGIC = b"FCAG"
#: Bumped whenever a frame's layout or meaning changes: both ends must agree.
PROTOCOL = 2
_PREFIX = struct.Struct(">4sIQ")
MAX_HEADER = 1 << 20
#: The most array bytes a frame may carry unless the reader says otherwise.
MAX_BODY = 1 << 31
MAX_RECORDS, MAX_ITEMS, MAX_ARRAYS, MAX_NAME = 8, 512, 4096, 256
_MAX_SOCKET_PATH = 107
#: Each read or write once connected (seconds): a peer that stalls is dropped.
IO_TIMEOUT = 30.0
#: The array types an instruction or a reply carries.
WIRE_DTYPES = frozenset(
    np.dtype(t).str
    for t in ("float16", "float32", "float64", "uint8", "int8", "int32", "int64", "bool")
)
#: What a relay may ask an agent: the kinds of task the aggregator signs, and ``hello``.
HELLO = "hello"
#: A hello's answer: one config record of the region's name, version, pid and code.
HELLO_RECORD, HELLO_REGION = "status", "region"
#: Config values: what Flower's ConfigRecord holds, bar lists; metric values: numbers.
Scalar = str | int | float | bool | bytes
Number = int | float


class ChannelError(FedciuicError):
    """A frame that is not one, too large, or cut off; or a peer that is not an agent."""


@dataclass(frozen=True)
class Frame:
    """One message on the channel: its own fields, its records and arrays."""

    meta: dict[str, Scalar] = field(default_factory=dict)
    config: dict[str, dict[str, Scalar]] = field(default_factory=dict)
    metrics: dict[str, dict[str, Number]] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None
    #: The sender's protocol and fedciuic version, as it declared them.
    peer: tuple[int, str] = (PROTOCOL, __version__)

    @property
    def error(self) -> str:
        """Why the agent refused (an answer's ``error``), or ""."""
        value = self.meta.get("error", "")
        return value if isinstance(value, str) else repr(value)


def mismatch(peer: tuple[int, str], what: str) -> str:
    """The one line that refuses a peer of another protocol."""
    return (
        f"fedciuic agent protocol mismatch: {what} speaks protocol {peer[0]} (fedciuic "
        f"{peer[1]}), this side speaks {PROTOCOL} (fedciuic {__version__}); install the "
        "same fedciuic version for the region's agent and the relay"
    )


def _tag(value: object, where: str, numbers_only: bool = False) -> object:
    if numbers_only and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ChannelError(f"{where}: a {type(value).__name__} cannot cross as a metric")
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        raise ChannelError(f"{where}: {value} is not a finite number")
    if isinstance(value, str | int | float | bool):
        return value
    raise ChannelError(f"{where}: a {type(value).__name__} cannot cross the channel")


def encode(frame: Frame) -> tuple[bytes, list[memoryview]]:
    """The frame's prefix and header, and its arrays' bytes (sent without a copy)."""
    # C order without np.ascontiguousarray, which turns a 0-d array into shape (1,).
    arrays = {k: np.asarray(v, order="C") for k, v in (frame.arrays or {}).items()}
    header = {
        "protocol": PROTOCOL,
        "fedciuic": __version__,
        "meta": {k: _tag(v, k) for k, v in frame.meta.items()},
        "config": {
            name: {k: _tag(v, f"{name}.{k}") for k, v in record.items()}
            for name, record in frame.config.items()
        },
        "metrics": {
            name: {k: _tag(v, f"{name}.{k}", numbers_only=True) for k, v in record.items()}
            for name, record in frame.metrics.items()
        },
        "arrays": None
        if frame.arrays is None
        else [[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()],
    }
    for name, array in arrays.items():
        if array.dtype.str not in WIRE_DTYPES:
            raise ChannelError(f"arrays.{name}: dtype {array.dtype} cannot cross the channel")
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(text) > MAX_HEADER:
        raise ChannelError(f"frame header of {len(text)} bytes (at most {MAX_HEADER})")
    # Flat first: a memoryview cannot cast an empty array of 2+ dims, shape (0, 4).
    body = [a.reshape(-1).data.cast("B") for a in arrays.values()]
    prefix = _PREFIX.pack(FRAME_MAGIC, len(text), sum(len(b) for b in body))
    return prefix + text, body


def send(sock: socket.socket, frame: Frame) -> None:
    head, body = encode(frame)
    sock.sendall(head)
    for chunk in body:
        sock.sendall(chunk)


def _read(sock: socket.socket, size: int, what: str) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        try:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        except TimeoutError:
            raise ChannelError(f"no answer within {sock.gettimeout():g}s ({what})") from None
        if n == 0:
            raise ChannelError(f"the connection closed in the {what} ({got} of {size} bytes)")
        got += n
    return buffer


def _untag(value: object, where: str, numbers_only: bool = False) -> Scalar:
    if isinstance(value, dict) and not numbers_only:
        if set(value) != {"b64"} or not isinstance(value["b64"], str):
            raise ChannelError(f"{where}: an object other than {{'b64': ...}}")
        try:
            return base64.b64decode(value["b64"], validate=True)
        except ValueError:
            raise ChannelError(f"{where}: not base64") from None
    if numbers_only and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ChannelError(f"{where}: a number expected")
    if not isinstance(value, str | int | float | bool):
        raise ChannelError(f"{where}: a {type(value).__name__} is not a scalar")
    return value


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ChannelError(f"{where}: a name of 1 to {MAX_NAME} characters expected")
    return value


def _records(value: object, where: str, numbers_only: bool) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict) or len(value) > MAX_RECORDS:
        raise ChannelError(f"{where}: an object of at most {MAX_RECORDS} records expected")
    out: dict[str, dict[str, Any]] = {}
    for name, record in value.items():
        _name(name, where)
        if not isinstance(record, dict) or len(record) > MAX_ITEMS:
            raise ChannelError(f"{where}.{name}: an object of at most {MAX_ITEMS} items expected")
        out[name] = {
            _name(k, f"{where}.{name}"): _untag(v, f"{where}.{name}.{k}", numbers_only)
            for k, v in record.items()
        }
    return out


def _layout(value: object, body: int) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]] | None:
    if value is None:
        if body:
            raise ChannelError(f"frame: {body} body bytes and no arrays")
        return None
    if not isinstance(value, list) or len(value) > MAX_ARRAYS:
        raise ChannelError(f"arrays: a list of at most {MAX_ARRAYS} expected")
    layout, total, names = [], 0, set()
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise ChannelError("arrays: each entry is [name, dtype, shape]")
        name, dtype, shape = item
        name = _name(name, "arrays")
        if name in names:
            raise ChannelError(f"arrays: {name!r} twice")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:  # a list is unhashable
            raise ChannelError(
                f"arrays.{name}: dtype {str(dtype)[:16]!r} is not one of {sorted(WIRE_DTYPES)}"
            )
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(type(d) is int and 0 <= d < 2**40 for d in shape)
        ):
            raise ChannelError(f"arrays.{name}: a shape of at most 8 non-negative sizes expected")
        kind = np.dtype(dtype)
        total += math.prod(shape) * kind.itemsize
        layout.append((name, kind, tuple(shape)))
    if total != body:
        raise ChannelError(f"arrays: their sizes add up to {total} bytes, the body has {body}")
    return layout


def receive(sock: socket.socket, *, max_body: int = MAX_BODY, wait: float | None = None) -> Frame:
    """One frame, checked before its body is read. ``wait``: how long its first bytes may
    take (the agent's work on a request); each read after that has :data:`IO_TIMEOUT`."""
    sock.settimeout(IO_TIMEOUT if wait is None else wait)
    try:
        prefix = _read(sock, _PREFIX.size, "frame prefix")
    finally:
        sock.settimeout(IO_TIMEOUT)
    magic, header_size, body_size = _PREFIX.unpack(prefix)
    if magic != FRAME_MAGIC:
        raise ChannelError("not a fedciuic agent frame (bad magic)")
    if header_size > MAX_HEADER:
        raise ChannelError(f"frame header of {header_size} bytes (at most {MAX_HEADER})")
    if body_size > max_body:
        raise ChannelError(f"frame body of {body_size} bytes (at most {max_body})")
    try:
        header = json.loads(
            bytes(_read(sock, header_size, "frame header")),
            parse_constant=_no_constant,
            parse_float=_finite,
        )
    except (ValueError, RecursionError) as err:
        raise ChannelError(f"frame header: not JSON ({str(err)[:80]})") from None
    if not isinstance(header, dict):
        raise ChannelError("frame header: a JSON object expected")
    protocol, version = header.get("protocol"), header.get("fedciuic")
    if type(protocol) is not int or not isinstance(version, str) or len(version) > 64:
        raise ChannelError("frame header: protocol (int) and fedciuic (version) expected")
    peer = (protocol, version)
    if protocol != PROTOCOL:
        raise ChannelError(mismatch(peer, "the other end"))
    if set(header) != {"protocol", "fedciuic", "meta", "config", "metrics", "arrays"}:
        raise ChannelError(f"frame header: keys {sorted(map(str, header))[:8]}")
    meta = _records({"meta": header["meta"]}, "frame", numbers_only=False)["meta"]
    layout = _layout(header["arrays"], body_size)
    arrays = None
    if layout is not None:
        arrays = {}
        for name, kind, shape in layout:
            data = _read(sock, math.prod(shape) * kind.itemsize, f"array {name}")
            arrays[name] = np.frombuffer(data, dtype=kind).reshape(shape)
    return Frame(
        meta,
        _records(header["config"], "config", numbers_only=False),
        _records(header["metrics"], "metrics", numbers_only=True),
        arrays,
        peer,
    )


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number")


def _finite(text: str) -> float:
    """A JSON number as a float; 1e400 would be inf, which no frame carries."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:24]} is not a finite number")
    return value


@dataclass(frozen=True)
class Peer:
    """The process on the other end of a Unix socket, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def check_socket(path: Path) -> os.stat_result:
    """The socket's stat, once only its owner could have put it there: anyone who can
    write its folder could swap in a socket of their own."""
    try:
        info = path.lstat()
        folder = path.parent.stat()
    except OSError as err:
        raise ChannelError(f"no agent socket at {path} ({err.strerror})") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise ChannelError(f"{path} is not a socket; point node config agent at the agent's")
    if folder.st_uid != info.st_uid or folder.st_mode & 0o022:
        raise ChannelError(
            f"{path}: its folder is not owned by the socket's owner (uid {info.st_uid}) or "
            "others may write to it, so anyone could have put this socket there; let the "
            "agent make its own socket folder (mode 0711)"
        )
    return info


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """``path`` as a Unix socket address: a path longer than one may be (107 bytes) goes
    through its folder's descriptor (``/proc/self/fd/N/NAME``, Linux)."""
    if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
        yield str(path)
        return
    if not Path("/proc/self/fd").is_dir():
        raise ChannelError(f"the socket {path} is longer than a Unix socket path may be")
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def bind(listener: socket.socket, path: Path) -> None:
    with _address(path) as where:
        listener.bind(where)


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection to the agent on ``path``, once the socket checks out and its process
    runs as the socket's owner; waits up to ``timeout`` for an agent still starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = check_socket(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                with _address(path) as where:
                    sock.connect(where)
            except OSError:
                sock.close()
                raise
            break
        # BlockingIOError (EAGAIN): the agent's listen backlog is full; it is busy, not gone.
        except (ChannelError, FileNotFoundError, ConnectionRefusedError, BlockingIOError) as err:
            if time.monotonic() >= deadline:
                raise ChannelError(
                    f"no agent answers on {path} within {timeout:g}s ({err}); start the "
                    "region's agent (fedciuic agent --config agent.toml)"
                ) from None
            time.sleep(0.2)
        except OSError as err:
            raise ChannelError(f"cannot connect to the agent on {path} ({err})") from None
    peer = peer_of(sock)
    if peer.uid != info.st_uid:
        sock.close()
        raise ChannelError(
            f"the process on {path} runs as uid {peer.uid}, the socket belongs to uid "
            f"{info.st_uid}: not the agent that made it"
        )
    return sock


def ask(path: Path, frame: Frame, *, timeout: float, connect_timeout: float = 10.0) -> Frame:
    """The agent's answer to ``frame``, within ``timeout`` seconds; a refusal (its
    ``error``) is returned as it is."""
    sock = connect(path, connect_timeout)
    with sock:
        sock.settimeout(IO_TIMEOUT)
        # The agent may have answered (a refusal) before it read all of the request.
        with contextlib.suppress(OSError):
            send(sock, frame)
        try:
            return receive(sock, wait=timeout)
        except OSError as err:
            raise ChannelError(f"the agent on {path} dropped the connection ({err})") from None
