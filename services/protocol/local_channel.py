"""The co-located drafter channel: frames over a Unix socket, and the feature ring in shared memory.

When a verifier and its drafter run on one host, a Draft call skips gRPC: the verifier writes each
sequence's commit features into its feature ring (a file in shared memory that both processes map) and
sends the DraftRequest, with `FeatureRef`s in place of the bytes, as one frame over the drafter's Unix
socket; the drafter answers with one frame. gRPC stays the path for remote drafters, long commits
(Append chunks) and any failure of this one.

Frame: 4-byte big-endian length of what follows, 1 kind byte, the payload (a serialized message).
Kinds: HELLO (verifier -> drafter: the ring's path, UTF-8), DRAFT (a DraftRequest), REPLY (a
DraftResponse, or an empty payload for HELLO), ERROR (a UTF-8 "CODE: details" for a call that failed as a
whole, as gRPC would have aborted it).

Feature ring: a file of `size` bytes. A record is a 16-byte header (generation, nbytes: two little-endian
u64) then the data, starting at a 64-byte boundary; records follow each other and wrap to offset 0 when
the next does not fit. The drafter copies a record while it serves the call that names it, so the
verifier only writes between calls; the generation guards against a stale or forged reference anyway.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct

HELLO, DRAFT, REPLY, ERROR = 1, 2, 3, 4
MAX_FRAME = 64 << 20  # bytes: a Draft call's message without its features is far smaller
_HEADER = struct.Struct("<QQ")  # generation, nbytes
_ALIGN = 64
RING_PREFIX = "ddtree-features-"


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(struct.pack(">IB", len(payload) + 1, kind) + payload)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame (kind, payload); ConnectionError when the peer closed or sent a malformed frame."""
    (length,) = struct.unpack(">I", _recv_exact(sock, 4))
    if not 1 <= length <= MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes (1..{MAX_FRAME})")
    body = _recv_exact(sock, length)
    return body[0], body[1:]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the channel")
        buf += chunk
    return bytes(buf)


def host_id() -> str:
    """This host's identity for the co-location check: its name and boot id (containers of one host that
    share neither /dev/shm nor the socket still fail the connection, and fall back to gRPC)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


class FeatureRing:
    """The verifier's side: a ring file it creates (`create`) and writes; the drafter's: `attach` (read)."""

    def __init__(self, path: str, size: int, writable: bool):
        self.path, self.size = path, size
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, flags)
        try:
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._pos, self._generation = 0, 0

    @classmethod
    def create(cls, size: int, directory: str | None = None) -> FeatureRing:
        if size < 4 * _ALIGN:
            raise ValueError(f"a feature ring needs at least {4 * _ALIGN} bytes, got {size}")
        path = os.path.join(directory or shared_dir(), f"{RING_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, writable=True)

    @classmethod
    def attach(cls, path: str) -> FeatureRing:
        """Map a verifier's ring read-only: a regular file named as `create` names them, nothing else."""
        if not os.path.basename(path).startswith(RING_PREFIX) or not os.path.isfile(path):
            raise ValueError(f"not a feature ring: {path[:200]!r}")
        return cls(path, os.path.getsize(path), writable=False)

    def fits(self, nbytes: int) -> bool:
        """A record of nbytes fits (at most half the ring: the records of one call never overwrite each other)."""
        return _HEADER.size + nbytes <= self.size // 2

    def write(self, data: memoryview | bytes) -> tuple[int, int, int]:
        """Append one record; (offset, nbytes, generation) of it."""
        n = len(data)
        if not self.fits(n):
            raise ValueError(f"{n} bytes do not fit a feature ring of {self.size}")
        if self._pos + _HEADER.size + n > self.size:
            self._pos = 0
        self._generation += 1
        at = self._pos
        self._map[at + _HEADER.size : at + _HEADER.size + n] = data
        _HEADER.pack_into(self._map, at, self._generation, n)
        self._pos = -(-(at + _HEADER.size + n) // _ALIGN) * _ALIGN
        return at, n, self._generation

    def read(self, offset: int, nbytes: int, generation: int) -> bytes:
        """A copy of the record at offset; ValueError when the reference is out of bounds or stale."""
        if offset % _ALIGN or offset + _HEADER.size + nbytes > self.size:
            raise ValueError(f"feature reference [{offset}, +{nbytes}) outside the ring of {self.size} bytes")
        got_generation, got_nbytes = _HEADER.unpack_from(self._map, offset)
        if (got_generation, got_nbytes) != (generation, nbytes):
            raise ValueError(f"stale feature reference: record {got_generation} of {got_nbytes} bytes at {offset}, "
                             f"expected record {generation} of {nbytes}")  # fmt: skip
        data = self._map[offset + _HEADER.size : offset + _HEADER.size + nbytes]
        if _HEADER.unpack_from(self._map, offset)[0] != generation:  # overwritten while copied
            raise ValueError(f"feature record {generation} at {offset} was overwritten while read")
        return data

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
